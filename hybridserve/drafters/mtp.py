"""Multi-token prediction (MTP): the target checkpoint's own ``mtp.*`` head as the drafter.

Two published layouts are loaded: Qwen's (:class:`MtpHead`) and Nemotron-H's
(:class:`NemotronHMtpHead`, below). Both compute the same thing in other names; the
drafter (:class:`MtpDrafter`) runs either.

Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints ship one MTP layer (``mtp_num_hidden_layers``,
``num_nextn_predict_layers`` in Qwen3-Next's config): ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.fc`` (``2 * hidden -> hidden``, no bias),
``mtp.layers.0.*`` (a full-attention decoder layer with the target's attention and MLP
shapes and names) and ``mtp.norm``; the token embedding and the LM head are the
target's. In the mixture-of-experts targets (Qwen3-Next with ``num_experts > 0``,
Qwen3.5-MoE) the layer's ``mlp`` is the target's sparse block: router ``mlp.gate``,
routed experts (``mlp.experts.N.gate_proj`` / ``up_proj`` / ``down_proj``, or stacked
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``),
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``; it is sparse where the target's
rule (``decoder_sparse_step``, ``mlp_only_layers``) makes a layer 0 sparse, as the
published heads are read. The vision-language checkpoints keep ``mtp.*`` at the top
level, beside ``model.language_model.*``.

For a slot ``t`` the head reads the token at ``t + 1`` and a hidden state ``h_t`` and
predicts the token at ``t + 2``::

    x = fc(concat(pre_fc_norm_embedding(embed(token[t + 1])), pre_fc_norm_hidden(h_t)))
    y = norm(decoder_layer(x))        # attends over the head's own K/V of slots <= t
    logits = lm_head(y)

``h_t`` is the target's final hidden state at position ``t`` for slots whose token the
target has computed, and the head's own output ``y`` of the slot before for the
drafting slots (the target has not computed those tokens yet).

Nemotron-H checkpoints (Nemotron 3 Super / Ultra: ``num_nextn_predict_layers: 1``) ship
one MTP *step* made of a short stack of Nemotron-H decoder layers, one per entry of
``mtp_layers_block_type`` (``["attention", "moe"]`` in the published configs and
transformers' default; the legacy string ``mtp_hybrid_override_pattern``, e.g. ``"*E"``,
says the same). ``mtp.layers.i`` is that stack's layer ``i`` with the target's module
names (``norm``, ``mixer.*``: attention without RoPE, a routed mixture of experts, or an
MLP); the first layer also holds the input fusion (``enorm``, ``hnorm``, ``eh_proj``:
``2 * hidden -> hidden``, no bias) and the last the output norm (``final_layernorm``)::

    x = eh_proj(concat(enorm(embed(token[t + 1])), hnorm(h_t)))
    y = final_layernorm(layers(x))      # h += mixer(norm(h)) per layer

Embedding and LM head are the target's. A Mamba layer in the MTP stack is refused: no
published checkpoint has one and its state would need pages of its own.

Neither head has recurrent state: its only cache is its attention layers' K/V, paged in
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
so this is the head attending over a shorter window, not a different computation
(Nemotron-H's attention has no positional encoding at all). The drafts may be worse
than with the full window; the output is the target's regardless.

Where the target replays decode graphs, the head's uniform steps replay graphs of their
own (:meth:`MtpDrafter.enable_graphs`, :class:`~hybridserve.runner.draft_graphs.MtpGraphs`):
the hidden states come in through a static buffer, the head's outputs go on to the next
step on the device, and the drafts are read back once per proposal.
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
from hybridserve.drafters.base import DraftRequest, draft_choices, draw_tensors, read_back_drafts
from hybridserve.drafters.draft_model import _keep_logq
from hybridserve.models.base import CacheSpec
from hybridserve.models.batch import ForwardBatch, ModelCaches
from hybridserve.models.config import ATTENTION, GDN, MAMBA, ModelConfig
from hybridserve.models.hybrid import DecoderLayer, NemotronHForCausalLM, build_norm
from hybridserve.models.step_plan import uniform_q
from hybridserve.runner.draft_graphs import DraftDraw, DraftRow, MtpGraphs, row_index

if TYPE_CHECKING:
    from hybridserve.config import EngineConfig

MTP_ARCHITECTURES = (
    "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM", "NemotronHForCausalLM",
)


def _text_config(path: str | Path) -> dict:
    raw = json.loads((Path(path) / "config.json").read_text())
    return raw.get("text_config") or raw


def mtp_num_layers(path: str | Path) -> int:
    """The number of MTP layers ``path/config.json`` declares (0: none)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    text = raw.get("text_config") or raw
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        for source in (text, raw):
            if source.get(key):
                return int(source[key])
    return 0


# transformers' NemotronHConfig: the MTP stack when the config names none.
_NEMOTRON_MTP_DEFAULT = ("attention", "moe")
_NEMOTRON_MTP_NAMES = {
    "attention": "attention", "full_attention": "attention", "moe": "moe", "mlp": "mlp",
    "mamba": "mamba", "linear_attention": "mamba",
}
_NEMOTRON_MTP_CODES = {"*": "attention", "E": "moe", "-": "mlp", "M": "mamba"}


def nemotron_mtp_block_types(raw: dict) -> tuple[str, ...]:
    """The layers of a Nemotron-H MTP step, as ``config.json`` (``raw``) declares them:
    ``mtp_layers_block_type`` (a list), else the legacy ``mtp_hybrid_override_pattern``
    (a string of ``* E - M``), else ``("attention", "moe")``; the legacy string wins
    over a list equal to that default, as transformers reads them. ValueError names the
    field for anything else."""
    field = "mtp_layers_block_type"
    listed = raw.get(field)
    if listed is None:
        types = _NEMOTRON_MTP_DEFAULT
    else:
        if not isinstance(listed, list) or not listed or any(
            t not in _NEMOTRON_MTP_NAMES for t in listed
        ):
            raise ValueError(
                f"config.json field {field!r}: expected a non-empty list of "
                f"{sorted(_NEMOTRON_MTP_NAMES)}, got {listed!r}"
            )
        types = tuple(_NEMOTRON_MTP_NAMES[t] for t in listed)
    pattern = raw.get("mtp_hybrid_override_pattern")
    if pattern is not None and types == _NEMOTRON_MTP_DEFAULT:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_NEMOTRON_MTP_CODES):
            raise ValueError(
                "config.json field 'mtp_hybrid_override_pattern': expected a string of "
                f"{sorted(_NEMOTRON_MTP_CODES)}, got {pattern!r}"
            )
        types = tuple(_NEMOTRON_MTP_CODES[c] for c in pattern)
    return types


def _plan(batch: ForwardBatch, policy) -> ForwardBatch:
    """A head's step plan: its layers are stateless, so just the decode-path decision."""
    if batch.planned:
        return batch
    q = uniform_q(batch.query_start) if policy.uniform_decode else 0
    return replace(batch, planned=True, uniform_q=q)


class _FusedHead(nn.Module):
    """What the MTP heads share: the embedding of the token at ``t + 1`` and the hidden
    state at ``t``, each normed, concatenated and projected back to ``hidden``
    (:meth:`fusion` names the three modules), then the head's layers
    (:meth:`run_layers`) under the head's step plan."""

    policy: object

    def fusion(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        """``(embedding norm, hidden norm, projection)``."""
        raise NotImplementedError

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The fused input ``h [T, hidden]`` through the head's layers and final norm."""
        raise NotImplementedError

    def forward(
        self,
        token_embeds: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        caches: ModelCaches,
    ) -> torch.Tensor:
        """``[T, hidden]`` embeddings of the tokens at ``t + 1`` and hidden states at ``t``
        -> the head's output ``y [T, hidden]`` (after its final norm)."""
        enorm, hnorm, proj = self.fusion()
        h = proj(torch.cat([enorm(token_embeds), hnorm(hidden)], dim=-1))
        return self.run_layers(h, _plan(batch, self.policy), caches)


class MtpHead(_FusedHead):
    """The Qwen ``mtp.*`` modules (see the module docstring); ``state_dict()`` names are
    the checkpoint's without the ``mtp.`` prefix."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        config = target.config
        if config.attention is None:
            raise ValueError("an MTP head needs the target's attention parameters")
        hidden = config.hidden_size
        # The MTP layer is decoder layer 0 of a one-layer stack: its MLP is the sparse
        # block exactly where the target's rule (decoder_sparse_step, mlp_only_layers;
        # every layer in Qwen3.5-MoE) makes layer 0 sparse, as the published heads are
        # read; the block's shapes and routing are the target's.
        sparse = 0 in config.moe_layers
        self.layer_config = config.with_overrides(
            layer_types=(ATTENTION,), mamba=None, gdn=None, layer_has_mlp=True,
            moe=config.moe if sparse else None, moe_layers=(0,) if sparse else (),
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

    def fusion(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.fc

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The one decoder layer, then ``mtp.norm``."""
        h, pending = self.layers[0](h, None, batch, caches)
        return self.norm.add_norm(h, pending, self.layer_config.residual_multiplier)[1]


def _refuse_recurrent(types: Sequence[str]) -> None:
    bad = sorted({t for t in types if t in (MAMBA, GDN)})
    if bad:
        raise ValueError(
            f"speculative_config.method='mtp': the MTP layers ({list(types)}) include {bad}; "
            "only attention, moe and mlp MTP layers are supported (every published "
            "Nemotron-H MTP head is ['attention', 'moe'])"
        )


class NemotronHMtpHead(_FusedHead):
    """The Nemotron-H ``mtp.*`` modules (see the module docstring): ``layers.i`` is
    layer ``i`` of the MTP stack with the target's names; ``layers.0`` also holds
    ``enorm``, ``hnorm`` and ``eh_proj``, the last layer ``final_layernorm``.
    ``state_dict()`` names are the checkpoint's without the ``mtp.`` prefix (experts
    stacked as in the target)."""

    def __init__(self, target: nn.Module, layer_config: ModelConfig) -> None:
        super().__init__()
        _refuse_recurrent(layer_config.layer_types)
        config = self.layer_config = layer_config
        hidden = config.hidden_size
        self.policy = policy = target.kernel_policy
        names = NemotronHForCausalLM.names
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, names, policy) for i in range(config.num_layers)
        )
        first, last = self.layers[0], self.layers[-1]
        first.enorm = build_norm(config, hidden, policy)
        first.hnorm = build_norm(config, hidden, policy)
        first.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        last.final_layernorm = build_norm(config, hidden, policy)
        a = config.attention
        self.cache_spec = CacheSpec(
            attention_layers=config.attention_layers,
            num_kv_heads=a.num_kv_heads if a else 0,
            head_dim=a.head_dim if a else 0,
            recurrent_layers=(),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path, target: nn.Module) -> NemotronHMtpHead:
        """The head ``path/config.json`` declares: the target's config with the MTP
        stack (:func:`nemotron_mtp_block_types`) as its layers."""
        raw = dict(_text_config(path))
        types = nemotron_mtp_block_types(raw)
        _refuse_recurrent(types)  # before the config parser asks for their parameters
        raw.pop("layer_types", None)
        raw.pop("hybrid_override_pattern", None)
        raw["layers_block_type"] = list(types)
        return cls(target, ModelConfig.from_dict(raw, source=f"{path}/config.json (MTP layers)"))

    def fusion(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        first = self.layers[0]
        return first.enorm, first.hnorm, first.eh_proj

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The MTP stack's layers, then the last one's ``final_layernorm``."""
        pending = None
        for layer in self.layers:
            h, pending = layer(h, pending, batch, caches)
        return self.layers[-1].final_layernorm.add_norm(h, pending)[1]


def build_mtp_head(path: str | Path, target: nn.Module) -> nn.Module:
    """The (unloaded) head of the checkpoint at ``path`` for its ``target``: the
    architecture's layout, parameters on the current default device."""
    if target.config.architecture == "NemotronHForCausalLM":
        return NemotronHMtpHead.from_checkpoint(path, target)
    return MtpHead(target)


def load_mtp_head(path: str | Path, target: nn.Module) -> nn.Module:
    """Build the MTP head of the checkpoint at ``path`` for its loaded ``target`` model.

    Weights are read as the target's are (:func:`hybridserve.models.loader.read_weights`):
    every ``mtp.*`` weight of the head present once with its shape, per-expert tensors
    (``mtp.layers.i.mixer.experts.N.up_proj.weight``, ``mtp.layers.0.mlp.experts.N.
    gate_proj.weight``) stacked, nothing unknown.
    Raises ValueError naming ``speculative_config.method`` when the architecture has no
    MTP support here or the checkpoint carries no (or an incomplete) ``mtp.*`` head."""
    from hybridserve.models.layers.moe import WeightSlot, checkpoint_slot
    from hybridserve.models.loader import check_coverage, checkpoint_files, read_weights

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
            "(mtp_num_hidden_layers / num_nextn_predict_layers)"
        )
    if layers != 1:
        raise ValueError(
            f"speculative_config.method='mtp': {layers} MTP layers declared; only one is "
            "supported (every published Qwen3.5 / Qwen3-Next / Nemotron-H checkpoint has one)"
        )
    p = next(target.parameters())
    with torch.device("meta"):
        head = build_mtp_head(path, target)
    expected = {"mtp." + name: tuple(t.shape) for name, t in head.state_dict().items()}
    files = {n: f for n, f in checkpoint_files(Path(path)).items() if n.startswith("mtp.")}
    slots, unexpected = {}, []
    for name, file in files.items():
        slot = WeightSlot(name) if name in expected else checkpoint_slot(name, expected)
        if slot is None or (slot.expert is not None and slot.expert >= expected[slot.param][0]):
            unexpected.append(name)
        else:
            slots[name] = (file, slot)
    if unexpected:
        unexpected.sort()
        raise ValueError(
            f"{files[unexpected[0]]}: unexpected MTP weight(s) {unexpected[:5]} for the "
            f"{arch} MTP head this config.json describes"
        )
    what = f"the MTP head of {arch} (speculative_config.method='mtp')"
    check_coverage(slots, expected, Path(path), what)
    state, _ = read_weights(slots, expected, p.device, p.dtype)
    head.load_state_dict({k.removeprefix("mtp."): t for k, t in state.items()}, strict=True, assign=True)
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
        # One KV block past the pool's range: the scratch block padding rows of the
        # head's graph steps write (enable_graphs).
        self.caches = head.cache_spec.allocate(
            num_kv_blocks + 1, kv_block_size, 1, dtype, dtype, device
        )
        self.num_kv_blocks = num_kv_blocks
        self.graphs: MtpGraphs | None = None
        self.blocks = BlockPool(num_kv_blocks, kv_block_size, enable_caching=False)
        self._seqs: dict[Hashable, _Seq] = {}
        self._hidden: dict[Hashable, tuple[int, torch.Tensor]] = {}
        self._clock = itertools.count(1)
        # Per key: log q of each draft of the latest proposal (sampled requests only).
        self.draft_logq: dict[Hashable, torch.Tensor] = {}
        self.counters = {"catch_up_tokens": 0, "draft_forwards": 0, "evictions": 0}

    def enable_graphs(self, max_blocks: int, max_rows: int,
                      capture: bool | None = None) -> MtpGraphs:
        """Replay the head's uniform steps from CUDA graphs over its own K/V
        (:class:`~hybridserve.runner.draft_graphs.MtpGraphs`: the hidden states come in
        through a static buffer); arguments as
        :meth:`DraftModelDrafter.enable_graphs
        <hybridserve.drafters.draft_model.DraftModelDrafter.enable_graphs>`."""
        self.graphs = MtpGraphs(
            self.head, self.target, self.caches, self.block_size, max_rows, max_blocks,
            self.num_kv_blocks, 0, self.device, capture,
        )
        return self.graphs

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
        reqs = [requests[i] for i, *_ in live]
        rows, tokens, hiddens = [], [], []
        for i, seq, toks, lo in live:
            length = len(toks)
            hstart, hidden = self._hidden[requests[i].key]
            rows.append((seq, lo, length - 1 - lo))
            tokens.append(toks[lo + 1 : length])
            hiddens.append(hidden[lo - hstart : length - 1 - hstart])
            self.counters["catch_up_tokens"] += length - 1 - lo
        first, first_logq, y = self._step(rows, reqs, 0, tokens, None, hiddens)
        for (i, seq, toks, _), _ in zip(live, rows):
            seq.filled = len(toks) - 1
            # Keep the hidden state of the last filled slot: a proposal no step consumed
            # redoes that slot.
            hstart, hidden = self._hidden[requests[i].key]
            drop = max(0, seq.filled - 1 - hstart)
            self._hidden[requests[i].key] = (hstart + drop, hidden[drop:].clone())
        # Drafting: each step feeds the drafts the step before chose, with its outputs y,
        # on the device; read back once at the end.
        n = len(live)
        steps = [(list(range(n)), first, first_logq)]
        cur = first
        step = 1
        while True:
            act = [j for j, (i, *_) in enumerate(live) if requests[i].k > step]
            if not act:
                break
            index = row_index(act, self.device)
            rows = [(live[j][1], len(live[j][2]) - 2 + step, 1) for j in act]
            drafts, logq, y_act = self._step(rows, [reqs[j] for j in act], step, None,
                                             cur.index_select(0, index),
                                             y.index_select(0, index))
            steps.append((act, drafts, logq))
            cur = cur.index_put((index,), drafts)
            y = y.index_put((index,), y_act)
            step += 1
        logqs = read_back_drafts(steps, [i for i, *_ in live], requests, out)
        _keep_logq(self.draft_logq, requests, logqs)
        return out

    def _step(
        self,
        rows: list[tuple[_Seq, int, int]],
        reqs: Sequence[DraftRequest],
        step: int,
        tokens: list[list[int]] | None,
        device_tokens: torch.Tensor | None,
        hidden: list[torch.Tensor] | torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft ``step`` of every ``(seq, first slot, slots)`` row from its tokens (host
        lists ``tokens``, or one a row in ``device_tokens``) and hidden states (one tensor
        a row, or ``[rows, hidden]`` of one-slot rows): rows of one length replay a graph
        step when graphs are on and they qualify, the rest run one eager forward.
        Returns the drafts ``[rows]``, ``log q [rows, vocab]`` when some request samples
        (else None) and the head's outputs at the rows' last slots ``[rows, hidden]``, on
        the device: nothing is read back."""
        n = len(rows)
        sampled = any(r.temperature > 0 for r in reqs)
        drafts = torch.empty(n, dtype=torch.long, device=self.device)
        logq = y = None
        pending = list(range(n))

        def put(index_list, d, q, last):
            nonlocal logq, y
            index = row_index(index_list, self.device)
            drafts.index_copy_(0, index, d)
            if q is not None:
                if logq is None:
                    logq = torch.empty(n, q.shape[1], dtype=q.dtype, device=self.device)
                logq.index_copy_(0, index, q)
            if y is None:
                y = torch.empty(n, last.shape[1], dtype=last.dtype, device=self.device)
            y.index_copy_(0, index, last)

        def hidden_of(group, index):
            if isinstance(hidden, torch.Tensor):
                return hidden if index is None else hidden.index_select(0, index)
            return torch.cat([hidden[j] for j in group])

        if self.graphs is not None:
            groups: dict[int, list[int]] = {}
            for j, (_, _, count) in enumerate(rows):
                groups.setdefault(count, []).append(j)
            for group in groups.values():
                drows = []
                for j in group:
                    seq, first, count = rows[j]
                    drows.append(DraftRow(first - seq.base, count, seq.blocks, -1, {},
                                          None if tokens is None else tokens[j]))
                whole = len(group) == n  # one group of every row, in order: no gathers
                index = None if whole else row_index(group, self.device)
                got = self.graphs.replay_rows(
                    drows, [DraftDraw.of(reqs[j], step) for j in group],
                    device_tokens if device_tokens is None or whole
                    else device_tokens.index_select(0, index),
                    hidden=hidden_of(group, index),
                )
                if got is None:
                    continue
                if whole:
                    return got
                put(group, *got)
                done = set(group)
                pending = [j for j in pending if j not in done]
        if pending:
            if tokens is not None:
                ids = row_index([t for j in pending for t in tokens[j]], self.device)
            index = row_index(pending, self.device)
            if tokens is None:
                ids = device_tokens.index_select(0, index)
            last = self._forward([rows[j] for j in pending], self.target.model.embed(ids),
                                 hidden_of(pending, index))
            logits = self.target.compute_logits(last)
            if sampled:
                args = draw_tensors([reqs[j] for j in pending], [step] * len(pending),
                                    self.device)
                chosen, q = draft_choices(logits, *args)
            else:
                chosen, q = torch.argmax(logits, dim=-1), None
            put(pending, chosen, q, last)
        return drafts, logq, y

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
