"""Multi-token prediction (MTP): the target checkpoint's own ``mtp.*`` head as the drafter.

Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints ship one MTP layer (``mtp_num_hidden_layers``,
``num_nextn_predict_layers`` in Qwen3-Next's config): ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.fc`` (``2 * hidden -> hidden``, no bias),
``mtp.layers.0.*`` (a full-attention decoder layer with the target's attention and MLP
shapes and names) and ``mtp.norm``; the token embedding and the LM head are the
target's. For a slot ``t`` the head reads the token at ``t + 1`` and a hidden state
``h_t`` and predicts the token at ``t + 2``::

    x = fc(concat(pre_fc_norm_embedding(embed(token[t + 1])), pre_fc_norm_hidden(h_t)))
    y = norm(decoder_layer(x))        # attends over the head's own K/V of slots <= t
    logits = lm_head(y)

``h_t`` is the target's final hidden state at position ``t`` for slots whose token the
target has computed, and the head's own output ``y`` of the slot before for the
drafting slots (the target has not computed those tokens yet).

The head has no recurrent state: its only cache is the decoder layer's K/V, paged in
blocks of the head's own pool and freed with the request (:meth:`MtpDrafter.forget`).
Lifecycle of one request with ``L`` tokens at a proposal, ``c`` slots filled:

1. **catch-up**: one row fills slots ``c .. L - 2`` from the target's hidden states of
   those positions (which the engine hands over after every step,
   :meth:`MtpDrafter.observe`: all tokens of a prefill chunk, the accepted positions of
   a verify row) and the tokens after them; its last slot's logits give draft ``d1``.
2. **drafting**: slots ``L - 1 .. L + k - 3`` take ``d1 .. d(k-1)`` with the previous
   slot's output ``y`` and give ``d2 .. dk``.
3. The drafting slots' K/V are provisional: the next catch-up (the target's hidden
   states of the accepted drafts and of the bonus token's predecessor are known by
   then) rewrites them. K/V past a row's context is never read, so nothing needs
   releasing; a rewrite of a slot with the same inputs writes the same values, so a
   proposal that no step consumed is simply redone.

After a prefix-cache hit the target computes no hidden state for the cached positions;
the head's slots then start at the first position it has a hidden state for (``base``),
with positions counted from there: RoPE attention depends only on relative positions,
so this is the head attending over a shorter window, not a different computation. The
drafts may be worse than with the full window; the output is the target's regardless.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridserve.cache.block_pool import BlockPool
from hybridserve.drafters.base import DraftRequest, choose_drafts
from hybridserve.drafters.draft_model import _keep_logq
from hybridserve.models.base import CacheSpec
from hybridserve.models.batch import ForwardBatch, ModelCaches
from hybridserve.models.config import ATTENTION
from hybridserve.models.hybrid import DecoderLayer, build_norm
from hybridserve.models.step_plan import uniform_q

if TYPE_CHECKING:
    from hybridserve.config import EngineConfig

MTP_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3NextForCausalLM")


def mtp_num_layers(path: str | Path) -> int:
    """The number of MTP layers ``path/config.json`` declares (0: none)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    text = raw.get("text_config") or raw
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        for source in (text, raw):
            if source.get(key):
                return int(source[key])
    return 0


class MtpHead(nn.Module):
    """The ``mtp.*`` modules (see the module docstring); ``state_dict()`` names are the
    checkpoint's without the ``mtp.`` prefix."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        config = target.config
        if config.attention is None:
            raise ValueError("an MTP head needs the target's attention parameters")
        hidden = config.hidden_size
        self.layer_config = config.with_overrides(
            layer_types=(ATTENTION,), mamba=None, gdn=None, layer_has_mlp=True
        )
        # The head runs the target's kernel paths (its policy, fixed at load).
        self.policy = policy = target.kernel_policy
        self.pre_fc_norm_embedding = build_norm(config, hidden, policy)
        self.pre_fc_norm_hidden = build_norm(config, hidden, policy)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(self.layer_config, 0, target.names, policy)])
        self.norm = build_norm(config, hidden, policy)
        a = config.attention
        self.cache_spec = CacheSpec(
            attention_layers=(0,), num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
            recurrent_layers=(),
        )

    def forward(
        self,
        token_embeds: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        caches: ModelCaches,
    ) -> torch.Tensor:
        """``[T, hidden]`` embeddings of the tokens at ``t + 1`` and hidden states at ``t``
        -> the head's output ``y [T, hidden]`` (after ``mtp.norm``)."""
        x = torch.cat(
            [self.pre_fc_norm_embedding(token_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1
        )
        h = self.fc(x)
        if not batch.planned:
            # The head's step plan: attention only, so just the decode-path decision.
            q = uniform_q(batch.query_start) if self.policy.uniform_decode else 0
            batch = replace(batch, planned=True, uniform_q=q)
        h, pending = self.layers[0](h, None, batch, caches)
        return self.norm.add_norm(h, pending, self.layer_config.residual_multiplier)[1]


def load_mtp_head(path: str | Path, target: nn.Module) -> MtpHead:
    """Build the MTP head of the checkpoint at ``path`` for its loaded ``target`` model.

    Raises ValueError naming ``speculative_config.method`` when the architecture has no
    MTP support here or the checkpoint carries no (or an incomplete) ``mtp.*`` head."""
    from safetensors import safe_open

    from hybridserve.models.loader import checkpoint_files

    arch = target.config.architecture
    if arch not in MTP_ARCHITECTURES:
        raise ValueError(
            f"speculative_config.method='mtp' needs a model with an MTP head "
            f"({', '.join(MTP_ARCHITECTURES)}); {arch} has none here"
        )
    layers = mtp_num_layers(path)
    if layers == 0:
        raise ValueError(
            f"speculative_config.method='mtp': {path}/config.json declares no MTP layers "
            "(mtp_num_hidden_layers)"
        )
    if layers != 1:
        raise ValueError(
            f"speculative_config.method='mtp': {layers} MTP layers declared; only one is "
            "supported (every published Qwen3.5 / Qwen3-Next checkpoint has one)"
        )
    p = next(target.parameters())
    with torch.device("meta"):
        head = MtpHead(target)
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    files = {n: f for n, f in checkpoint_files(Path(path)).items() if n.startswith("mtp.")}
    missing = sorted(set(expected) - {n.removeprefix("mtp.") for n in files})
    if missing:
        raise ValueError(
            f"speculative_config.method='mtp': the checkpoint at {path} lacks MTP weight(s) "
            f"{['mtp.' + m for m in missing[:5]]}"
        )
    state = {}
    for name, file in files.items():
        key = name.removeprefix("mtp.")
        if key not in expected:
            raise ValueError(f"{file}: unexpected MTP weight {name!r}")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        if tuple(t.shape) != expected[key]:
            raise ValueError(
                f"{file}: MTP weight {name!r} has shape {list(t.shape)}, expected "
                f"{list(expected[key])}"
            )
        state[key] = t.to(device=p.device, dtype=p.dtype)
    head.load_state_dict(state, strict=True, assign=True)
    head.requires_grad_(False)
    return head.eval()


@dataclass
class _Seq:
    blocks: list[int]
    base: int  # first position with a slot (0 unless the first prefill hit the cache)
    filled: int  # slots base .. filled - 1 hold the K/V of known tokens
    hidden: torch.Tensor | None = None  # the target's hidden states of positions hstart ..
    hstart: int = 0
    last_used: int = 0


class MtpDrafter:
    """Drafts with the target's MTP head (see the module docstring).

    ``needs_hidden``: the engine hands the target's hidden states of every step's rows
    to :meth:`observe` (and runs steps eagerly, where they exist)."""

    needs_hidden = True

    def __init__(
        self,
        target: nn.Module,
        head: MtpHead,
        num_kv_blocks: int,
        kv_block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.target = target
        self.head = head
        self.block_size = kv_block_size
        self.device = torch.device(device)
        self.caches = head.cache_spec.allocate(
            num_kv_blocks, kv_block_size, 1, dtype, dtype, device
        )
        self.blocks = BlockPool(num_kv_blocks, kv_block_size, enable_caching=False)
        self._seqs: dict[Hashable, _Seq] = {}
        self._hidden: dict[Hashable, tuple[int, torch.Tensor]] = {}
        self._clock = itertools.count(1)
        # Per key: log q of each draft of the latest proposal (sampled requests only).
        self.draft_logq: dict[Hashable, torch.Tensor] = {}
        self.counters = {"catch_up_tokens": 0, "draft_forwards": 0, "evictions": 0}

    @classmethod
    def from_config(cls, config: EngineConfig, target: nn.Module) -> MtpDrafter:
        path = getattr(target, "checkpoint_path", None) or config.model
        head = load_mtp_head(path, target)
        cc = config.cache
        return cls(target, head, cc.num_kv_blocks, cc.kv_block_size, config.dtype, config.device)

    # ---- what the engine hands over ------------------------------------------------

    def observe(self, key: Hashable, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states of positions ``start .. start + len - 1`` of
        request ``key`` (computed on the request's true tokens)."""
        if hidden.shape[0] == 0:
            return
        seq_hidden = self._hidden.get(key)
        if seq_hidden is None or start > seq_hidden[0] + seq_hidden[1].shape[0] or start < seq_hidden[0]:
            self._hidden[key] = (start, hidden.clone())
            return
        hstart, old = seq_hidden
        self._hidden[key] = (hstart, torch.cat([old[: start - hstart], hidden]))

    def forget(self, key: Hashable) -> None:
        self.draft_logq.pop(key, None)
        self._hidden.pop(key, None)
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self.blocks.release(seq.blocks)

    # ---- proposing ------------------------------------------------------------------

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        for r in requests:
            self.draft_logq.pop(r.key, None)
        live = []  # (index, seq, toks, lo): catch-up slots lo .. L - 2
        keep = {id(s) for r in requests if (s := self._seqs.get(r.key)) is not None}
        for i, r in enumerate(requests):
            toks = list(r.token_ids)
            length = len(toks)
            got = self._hidden.get(r.key)
            if r.k <= 0 or got is None or length < 2:
                continue
            hstart, hidden = got
            seq = self._seqs.get(r.key)
            lo = None
            if seq is not None:
                # Redo the last filled slot if nothing new arrived (a proposal no step used).
                lo = max(min(seq.filled, length - 2), seq.base)
                if lo < hstart:
                    # The hidden states of the slots to fill are gone (a recompute that hit
                    # the prefix cache past them): start the head's window afresh.
                    self.forget_slots(r.key)
                    seq = None
            if seq is None:
                if hstart > length - 2:
                    continue
                seq = self._seqs[r.key] = _Seq(blocks=[], base=hstart, filled=hstart)
                keep.add(id(seq))
                lo = hstart
            if hstart + hidden.shape[0] < length - 1:
                continue  # the target's hidden state of position L - 2 is not here
            seq.last_used = next(self._clock)
            if not self._reserve(seq, length - 2 + r.k - seq.base, keep):
                self.forget_slots(r.key)
                continue
            live.append((i, seq, toks, lo))
        if not live:
            return out
        embed = self.target.model.embed
        rows, tokens, hiddens = [], [], []
        for i, seq, toks, lo in live:
            length = len(toks)
            hstart, hidden = self._hidden[requests[i].key]
            rows.append((seq, lo, length - 1 - lo))
            tokens += toks[lo + 1 : length]
            hiddens.append(hidden[lo - hstart : length - 1 - hstart])
            self.counters["catch_up_tokens"] += length - 1 - lo
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        y = self._forward(rows, embed(ids), torch.cat(hiddens))
        for (i, seq, toks, _), _ in zip(live, rows):
            seq.filled = len(toks) - 1
            # Keep the hidden state of the last filled slot: a proposal no step consumed
            # redoes that slot.
            hstart, hidden = self._hidden[requests[i].key]
            drop = max(0, seq.filled - 1 - hstart)
            self._hidden[requests[i].key] = (hstart + drop, hidden[drop:].clone())
        logq: dict[int, list] = {i: [] for i, *_ in live}
        drafts, qs = choose_drafts(self.target.compute_logits(y), [requests[i] for i, *_ in live], 0)
        for (i, *_), d, q in zip(live, drafts, qs):
            out[i].append(d)
            logq[i].append(q)
        step = 1
        while True:
            sel = [j for j, (i, *_) in enumerate(live) if len(out[i]) < requests[i].k]
            if not sel:
                break
            live, y = [live[j] for j in sel], y[sel]
            rows = [(seq, len(toks) - 2 + step, 1) for _, seq, toks, _ in live]
            ids = torch.tensor([out[i][-1] for i, *_ in live], dtype=torch.long, device=self.device)
            y = self._forward(rows, embed(ids), y)
            drafts, qs = choose_drafts(self.target.compute_logits(y), [requests[i] for i, *_ in live], step)
            for (i, *_), d, q in zip(live, drafts, qs):
                out[i].append(d)
                logq[i].append(q)
            step += 1
        _keep_logq(self.draft_logq, requests, logq)
        return out

    def forget_slots(self, key: Hashable) -> None:
        """Drop the head's K/V of ``key`` (its hidden states stay)."""
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self.blocks.release(seq.blocks)

    def _reserve(self, seq: _Seq, slots: int, keep: set[int]) -> bool:
        need = -(-slots // self.block_size) - len(seq.blocks)
        while need > self.blocks.num_free:
            victims = [(s.last_used, k) for k, s in self._seqs.items() if id(s) not in keep]
            if not victims:
                return False
            self.forget_slots(min(victims)[1])
            self.counters["evictions"] += 1
        if need > 0:
            seq.blocks += self.blocks.allocate(need)
        return True

    def _forward(self, rows: list[tuple[_Seq, int, int]], embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One packed forward of ``(seq, first slot, slots)`` rows; the head's outputs at
        each row's last slot ``[rows, hidden]``."""
        self.counters["draft_forwards"] += 1
        bs = self.block_size
        positions, slots, query_start, computed = [], [], [0], []
        max_blocks = max(len(seq.blocks) for seq, _, _ in rows)
        tables = torch.full((len(rows), max_blocks), -1, dtype=torch.int32)
        for r, (seq, first, count) in enumerate(rows):
            rel = first - seq.base
            for pos in range(rel, rel + count):
                positions.append(pos)
                slots.append(seq.blocks[pos // bs] * bs + pos % bs)
            query_start.append(query_start[-1] + count)
            computed.append(rel)
            tables[r, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        dev = self.device
        batch = ForwardBatch(
            query_start=query_start,
            num_computed=computed,
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            context_lens=[c + (query_start[r + 1] - query_start[r]) for r, c in enumerate(computed)],
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_in_page=[-1] * len(rows),
            state_out_row=[],
            state_out_offset=[],
            state_out_page=[],
        )
        y = self.head(embeds, hidden.to(embeds.dtype), batch, self.caches)
        last = torch.tensor([e - 1 for e in query_start[1:]], dtype=torch.long, device=dev)
        return y[last]

    def check_integrity(self) -> None:
        blocks = [b for s in self._seqs.values() for b in s.blocks]
        if len(blocks) + self.blocks.num_free != self.blocks.num_blocks or len(set(blocks)) != len(blocks):
            raise AssertionError("MTP KV blocks leaked or double-held")
