"""A minimal stand-in for the runner, for model-layer tests: pages, block tables, batches.

It owns KV blocks (handed out in order, never shared) and state pages (a free list), and
turns "run these tokens for these sequences" into one packed :class:`ForwardBatch`.
Every step writes each row's new state to a fresh page and frees the page it read, the
ping-pong the engine does (docs/state-lifecycle.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridserve.models.batch import ForwardBatch


@dataclass
class Sequence:
    tokens: list[int] = field(default_factory=list)  # tokens already in the caches
    blocks: list[int] = field(default_factory=list)
    state_page: int = -1


class PagedDriver:
    def __init__(
        self,
        model,
        *,
        kv_block_size: int = 4,
        num_kv_blocks: int = 256,
        num_state_pages: int = 64,
        ssm_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.block_size = kv_block_size
        dtype = next(model.parameters()).dtype
        if ssm_dtype is None:
            ssm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.caches = model.cache_spec.allocate(
            num_kv_blocks, kv_block_size, num_state_pages, dtype, ssm_dtype, "cpu"
        )
        # Poison every cache so reading anything not written by the model shows up.
        for k, v in self.caches.kv.values():
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        for t in [*self.caches.conv.values(), *self.caches.ssm.values()]:
            t.fill_(float("nan"))
        self.next_block = 0
        self.free_pages = list(range(num_state_pages))
        self.seqs: dict[int, Sequence] = {}

    def take_page(self) -> int:
        return self.free_pages.pop(0)

    def conv_state(self, layer: int, page: int) -> torch.Tensor:
        return self.caches.conv[layer][page].clone()

    def ssm_state(self, layer: int, page: int) -> torch.Tensor:
        return self.caches.ssm[layer][page].clone()

    def step(
        self,
        rows: list[tuple[int, list[int]]],
        extra_state_offsets: dict[int, list[int]] | None = None,
        advance: bool = True,
    ) -> tuple[torch.Tensor, dict[int, dict[int, int]]]:
        """Run ``rows = [(seq_id, new_tokens), ...]`` as one packed forward.

        Every row writes the state after its last token (it becomes the sequence's state
        when ``advance``) plus the offsets in ``extra_state_offsets[seq_id]``.
        Returns ``(logits [T, vocab], {seq_id: {offset: page}})``.
        """
        extra_state_offsets = extra_state_offsets or {}
        query_start, num_computed, positions, context_lens, slots = [0], [], [], [], []
        tables, state_in, out_row, out_off, out_page = [], [], [], [], []
        pages: dict[int, dict[int, int]] = {}
        ids: list[int] = []
        for i, (sid, toks) in enumerate(rows):
            seq = self.seqs.setdefault(sid, Sequence())
            n, q = len(seq.tokens), len(toks)
            while len(seq.blocks) * self.block_size < n + q:
                seq.blocks.append(self.next_block)
                self.next_block += 1
            ids += toks
            query_start.append(query_start[-1] + q)
            num_computed.append(n)
            context_lens.append(n + q)
            for p in range(n, n + q):
                positions.append(p)
                slots.append(
                    seq.blocks[p // self.block_size] * self.block_size + p % self.block_size
                )
            tables.append(seq.blocks)
            state_in.append(seq.state_page)
            offsets = sorted(set(extra_state_offsets.get(sid, [])) | {q - 1})
            pages[sid] = {}
            for off in offsets:
                page = self.take_page()
                pages[sid][off] = page
                out_row.append(i)
                out_off.append(off)
                out_page.append(page)
        width = max(len(t) for t in tables)
        block_tables = torch.full((len(rows), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        batch = ForwardBatch(
            query_start=query_start,
            num_computed=num_computed,
            positions=torch.tensor(positions, dtype=torch.int64),
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            state_in_page=state_in,
            state_out_row=out_row,
            state_out_offset=out_off,
            state_out_page=out_page,
        )
        batch.validate()
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, dtype=torch.int64), batch, self.caches)
            logits = self.model.compute_logits(hidden)
        if advance:
            for sid, toks in rows:
                seq = self.seqs[sid]
                if seq.state_page >= 0:
                    self.free_pages.append(seq.state_page)
                seq.tokens += toks
                seq.state_page = pages[sid][len(toks) - 1]
        return logits, pages

    def greedy(self, sid: int, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Prefill ``prompt`` in one step, then decode one token per step."""
        logits, _ = self.step([(sid, prompt)])
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens:
            logits, _ = self.step([(sid, [out[-1]])])
            out.append(int(logits[-1].argmax()))
        return out
