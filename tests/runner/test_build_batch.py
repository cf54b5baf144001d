"""``ModelRunner.build_batch``: the packed ids, positions and KV slots of a step whose rows
mix prefill chunks (built in numpy) with decode and verify rows (Python ints), in row
order, against ``kv_slot`` token by token."""

from types import SimpleNamespace

import pytest
import torch

from hybridserve.runner.model_runner import ModelRunner
from hybridserve.step import ScheduledRow, SchedulerOutput, kv_slot


def _row(g, computed, tokens, drafts=0, block_size=16):
    blocks = torch.randperm(1000, generator=g)[: -(-(computed + tokens) // block_size) + 2]
    req = SimpleNamespace(
        all_token_ids=torch.randint(0, 500, (computed + tokens,), generator=g).tolist(),
        draft_token_ids=torch.randint(0, 500, (drafts,), generator=g).tolist(),
        block_ids=blocks.tolist())
    return ScheduledRow(req, computed, tokens, drafts, True, 3, state_outputs={})


@pytest.mark.parametrize("shape", [
    [(0, 200)],  # one prefill chunk
    [(5, 1), (0, 130), (7, 3, 2), (64, 64), (9, 1)],  # long rows among short ones
    [(5, 1), (8, 4, 3)],  # short rows only
    [(100, 63), (0, 64)],  # both sides of the threshold
])
def test_positions_and_slots_in_row_order(shape):
    g = torch.Generator().manual_seed(len(shape))
    rows = [_row(g, *s) for s in shape]
    runner = SimpleNamespace(block_size=16, device="cpu")
    ids, batch = ModelRunner.build_batch(runner, SchedulerOutput(rows))
    want_ids, want_pos, want_slots = [], [], []
    for r in rows:
        n, q, d = r.num_computed, r.num_tokens, r.num_drafts
        want_ids += r.request.all_token_ids[n : n + q - d] + r.request.draft_token_ids[:d]
        want_pos += list(range(n, n + q))
        want_slots += [kv_slot(r.request.block_ids, p, 16) for p in range(n, n + q)]
    assert ids.tolist() == want_ids
    assert batch.positions.tolist() == want_pos and batch.positions.dtype == torch.long
    assert batch.slot_mapping.tolist() == want_slots
    assert batch.query_start[-1] == len(want_pos)

