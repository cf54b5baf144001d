"""How a model is cut over the ranks of a tensor-parallel group, and loading one rank's cut.

Rank ``r`` of ``tp`` ranks holds (``H`` Mamba heads, ``G`` groups; ``Hq`` / ``Hkv``
attention heads):

- **Mamba2**: heads ``[r H/tp, (r+1) H/tp)`` with their channels of ``z``, ``x``, ``dt``,
  ``dt_bias``, ``A_log``, ``D``, the conv channels of ``x`` and the gated norm's weight.
  Groups (``B``, ``C`` and their conv channels): split when ``G % tp == 0`` (rank ``r``
  holds groups ``[r G/tp, (r+1) G/tp)``, exactly those its heads read); when ``tp % G ==
  0`` every rank's heads lie in one group, which the rank holds (``G = 1``: every rank
  holds the one group, i.e. groups are replicated). Anything else is refused. The gated
  RMSNorm normalises each of its ``G`` groups of ``H P / G`` channels over the whole
  group: when a group lies inside one rank the rank normalises alone, when it spans
  ranks (``tp % G == 0``, ``tp > G``) the ranks all-reduce their partial sums of squares
  (:class:`SpanningGatedRMSNorm`). ``out_proj`` is row-parallel.
- **Attention**: query heads split; key / value heads split when ``Hkv % tp == 0``, else
  (``tp % Hkv == 0``) rank ``r`` holds kv head ``r // (tp / Hkv)``, the one its query
  heads read (replicated over ``tp / Hkv`` ranks). ``o_proj`` is row-parallel.
- **Dense MLP**: gate / up columns split (column-parallel), ``down`` row-parallel.
- **Row-parallel** projections (:class:`RowParallelLinear`) multiply their input columns,
  all-reduce, then add the bias once: one all-reduce per mixer and one per MLP.
- **Mixture of experts**: the router replicated (every rank chooses the same experts
  from the same inputs), every routed expert's columns split as a dense MLP's are, the
  routed output all-reduced (in the latent space of a latent mixture, before the
  replicated ``fc2_latent_proj``); a shared expert is a dense MLP (its own reduce).
- **Embedding**: replicated. A lookup reads only the rows of the step's tokens, so a
  split would save memory but no bandwidth, and would cost one more all-reduce a step.
- **LM head**: vocabulary-parallel (:class:`VocabParallelHead`): every decode step reads
  the whole head (``V x hidden``, about 1 GiB for a 128k vocabulary at hidden 4096 in
  bf16), so splitting it divides that read; the ranks' logits are all-gathered (every
  rank gets the full ``[N, V]``; rank 0 samples from them). A tied head is cut from the
  replicated embedding.

Each rank's state page therefore holds its heads' SSM states and its conv channels;
its KV blocks hold its kv heads. Page and block ids are the same on every rank.

- **Gated DeltaNet**: key heads split, with the value heads each serves (value head
  ``h`` reads key head ``h // (Hv / Hk)``, so a rank's value heads are contiguous): their
  q, k, v conv channels, ``z``, ``b``, ``a``, ``dt_bias``, ``A_log``; the per-head output
  norm replicated; ``out_proj`` row-parallel. **Gated attention** (Qwen): each query
  head's rows and its gate's together, q / k norms replicated.

Counts that do not divide as above are refused with an error naming
``tensor_parallel_size`` and the field.

:func:`load_model_shard` builds rank ``r``'s model and reads only its slices of every
weight from the memory-mapped safetensors (``get_slice``), after the same checks as
:func:`~hybridserve.models.loader.load_model` against the full shapes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.config import KernelPolicy, resolve_dtype
from hybridserve.models import loader
from hybridserve.models.config import ConfigError, ModelConfig
from hybridserve.models.layers.attention import Attention
from hybridserve.models.layers.gated_deltanet import GatedDeltaNet
from hybridserve.models.layers.mamba2 import Mamba2Mixer
from hybridserve.models.layers.mlp import FusedGatedMLP, GatedMLP, PlainMLP
from hybridserve.models.layers.moe import FLOAT32_WEIGHTS, Experts, MoEBlock
from hybridserve.models.layers.norm import GatedRMSNorm
from hybridserve.models.registry import model_class

# (dim, [(lo, hi), ...]): the ranges of axis ``dim`` (0 rows, 1 columns, 2 a stacked
# expert tensor's last axis) a rank reads, concatenated along that axis.
Slices = tuple[int, tuple[tuple[int, int], ...]]


def _refuse(what: str, tp: int) -> ConfigError:
    return ConfigError(f"tensor_parallel_size={tp}: {what}")


@dataclass(frozen=True)
class ShardLayout:
    """Which heads, groups and columns rank ``rank`` of ``world_size`` holds (see the
    module docstring); built and validated by :meth:`of`."""

    rank: int
    world_size: int
    config: ModelConfig  # the full model's
    local: ModelConfig  # this rank's: the same layers with its share of heads and columns
    mamba_heads: tuple[int, int] = (0, 0)
    mamba_groups: tuple[int, int] = (0, 0)
    attn_heads: tuple[int, int] = (0, 0)
    kv_heads: tuple[int, int] = (0, 0)
    mlp_cols: tuple[int, int] = (0, 0)
    gdn_key_heads: tuple[int, int] = (0, 0)
    vocab_rows: tuple[int, int] = (0, 0)
    vocab_padded: int = 0  # rows of every rank's head shard (the last one zero-padded)

    @property
    def norm_spans_ranks(self) -> bool:
        """The Mamba gated norm's groups span ranks (their sums of squares are reduced)."""
        m = self.config.mamba
        return m is not None and m.n_groups % self.world_size != 0

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world_size: int) -> ShardLayout:
        tp = world_size
        a, m, mlp = config.attention, config.mamba, config.mlp
        fields: dict = {}
        local: dict = {}

        def split(total: int, what: str) -> tuple[int, int]:
            if total % tp:
                raise _refuse(f"{what}={total} does not divide by the rank count", tp)
            n = total // tp
            return (rank * n, (rank + 1) * n)

        if m is not None:
            fields["mamba_heads"] = split(m.n_heads, "Mamba2 n_heads")
            if m.n_groups % tp == 0:
                fields["mamba_groups"] = split(m.n_groups, "Mamba2 n_groups")
            elif tp % m.n_groups == 0:
                g = rank // (tp // m.n_groups)
                fields["mamba_groups"] = (g, g + 1)
            else:
                raise _refuse(
                    f"Mamba2 n_groups={m.n_groups} neither divides by nor divides the rank "
                    "count", tp)
            lo, hi = fields["mamba_groups"]
            local["mamba"] = dataclasses.replace(m, n_heads=m.n_heads // tp, n_groups=hi - lo)
        if a is not None:
            fields["attn_heads"] = split(a.num_heads, "attention num_attention_heads")
            if a.num_kv_heads % tp == 0:
                fields["kv_heads"] = split(a.num_kv_heads, "attention num_key_value_heads")
            elif tp % a.num_kv_heads == 0:
                k = rank // (tp // a.num_kv_heads)
                fields["kv_heads"] = (k, k + 1)
            else:
                raise _refuse(
                    f"num_key_value_heads={a.num_kv_heads} neither divides by nor divides "
                    "the rank count", tp)
            lo, hi = fields["kv_heads"]
            local["attention"] = dataclasses.replace(
                a, num_heads=a.num_heads // tp, num_kv_heads=hi - lo
            )
        if mlp is not None:
            fields["mlp_cols"] = split(mlp.intermediate_size, "MLP intermediate_size")
            local["mlp"] = dataclasses.replace(mlp, intermediate_size=mlp.intermediate_size // tp)
        gdn = config.gdn
        if gdn is not None:
            fields["gdn_key_heads"] = split(gdn.num_key_heads, "Gated DeltaNet num_k_heads")
            local["gdn"] = dataclasses.replace(
                gdn, num_key_heads=gdn.num_key_heads // tp,
                num_value_heads=gdn.num_value_heads // tp,
            )
        moe = config.moe
        if moe is not None:
            split(moe.intermediate_size, "expert width moe_intermediate_size")
            if moe.shared_intermediate_size:
                split(moe.shared_intermediate_size, "shared expert width")
            local["moe"] = dataclasses.replace(
                moe, intermediate_size=moe.intermediate_size // tp,
                shared_intermediate_size=moe.shared_intermediate_size // tp,
            )
        per = -(-config.vocab_size // tp)
        fields["vocab_rows"] = (min(rank * per, config.vocab_size),
                                min((rank + 1) * per, config.vocab_size))
        fields["vocab_padded"] = per
        return cls(rank, tp, config, dataclasses.replace(config, **local), **fields)

    # ---- the slices of each weight ---------------------------------------------------

    def slices(self, model: nn.Module) -> dict[str, Slices]:
        """Model-side weight name -> the slices of the full tensor this rank holds, for
        every weight that is cut (the rest are read whole)."""
        out: dict[str, Slices] = {}
        for prefix, mod in model.named_modules():
            pre = f"{prefix}." if prefix else ""
            if isinstance(mod, Mamba2Mixer):
                self._mamba_slices(pre, mod, out)
            elif isinstance(mod, GatedDeltaNet):
                self._gdn_slices(pre, mod, out)
            elif isinstance(mod, Attention):
                d = self.config.attention.head_dim
                q = ((self.attn_heads[0] * d, self.attn_heads[1] * d),)
                # Gated attention's q_proj holds, per head, the query then its gate.
                gated = self.config.attention.output_gate
                q_rows = ((2 * q[0][0], 2 * q[0][1]),) if gated else q
                kv = ((self.kv_heads[0] * d, self.kv_heads[1] * d),)
                for name, rows in (("q_proj", q_rows), ("k_proj", kv), ("v_proj", kv)):
                    out[f"{pre}{name}.weight"] = (0, rows)
                    if mod.q_proj.bias is not None:
                        out[f"{pre}{name}.bias"] = (0, rows)
                out[f"{pre}o_proj.weight"] = (1, q)
            elif isinstance(mod, FusedGatedMLP):
                cols = self._cols(mod.output_linear.in_features)
                i = mod.output_linear.in_features * self.world_size
                lo, hi = cols
                rows = ((lo, hi), (i + lo, i + hi))
                out[f"{pre}input_linear.weight"] = (0, rows)
                if mod.input_linear.bias is not None:
                    out[f"{pre}input_linear.bias"] = (0, rows)
                out[f"{pre}output_linear.weight"] = (1, (cols,))
            elif isinstance(mod, (GatedMLP, PlainMLP)):
                # The dense MLP and a mixture's shared expert alike: columns of this
                # module's own width (the local model was built with the rank's share).
                cols = (self._cols(mod.down_proj.in_features),)
                ins = ("gate_proj", "up_proj") if isinstance(mod, GatedMLP) else ("up_proj",)
                for name in ins:
                    out[f"{pre}{name}.weight"] = (0, cols)
                    if getattr(mod, name).bias is not None:
                        out[f"{pre}{name}.bias"] = (0, cols)
                out[f"{pre}down_proj.weight"] = (1, cols)
            elif isinstance(mod, Experts):
                # Every expert's columns: [E, 2I, H] gate then up rows, or [E, I, H]; the
                # down projection [E, H, I] by its last axis.
                n = mod.down_proj.shape[2]
                lo, hi = self._cols(n)
                if mod.gated:
                    i = n * self.world_size
                    out[f"{pre}gate_up_proj"] = (1, ((lo, hi), (i + lo, i + hi)))
                else:
                    out[f"{pre}up_proj"] = (1, ((lo, hi),))
                out[f"{pre}down_proj"] = (2, ((lo, hi),))
        return out

    def _gdn_slices(self, pre: str, mod: GatedDeltaNet, out: dict[str, Slices]) -> None:
        g = self.config.gdn
        dk, dv = g.key_head_dim, g.value_head_dim
        r = g.num_value_heads // g.num_key_heads
        k0, k1 = self.gdn_key_heads
        v0, v1 = k0 * r, k1 * r
        # The conv's channels: q of the rank's key heads, their k, then their values.
        conv = ((k0 * dk, k1 * dk), (g.key_dim + k0 * dk, g.key_dim + k1 * dk),
                (2 * g.key_dim + v0 * dv, 2 * g.key_dim + v1 * dv))
        out[f"{pre}conv1d.weight"] = (0, conv)
        if g.fused_projections:
            # Laid out per key head: [q_j, k_j, v_j, z_j] and [b_j, a_j].
            block = 2 * dk + 2 * r * dv
            out[f"{pre}in_proj_qkvz.weight"] = (0, ((k0 * block, k1 * block),))
            out[f"{pre}in_proj_ba.weight"] = (0, ((k0 * 2 * r, k1 * 2 * r),))
        else:
            out[f"{pre}in_proj_qkv.weight"] = (0, conv)
            out[f"{pre}in_proj_z.weight"] = (0, ((v0 * dv, v1 * dv),))
            out[f"{pre}in_proj_b.weight"] = (0, ((v0, v1),))
            out[f"{pre}in_proj_a.weight"] = (0, ((v0, v1),))
        out[f"{pre}dt_bias"] = (0, ((v0, v1),))
        out[f"{pre}A_log"] = (0, ((v0, v1),))
        out[f"{pre}out_proj.weight"] = (1, ((v0 * dv, v1 * dv),))

    def _cols(self, local_width: int) -> tuple[int, int]:
        return (self.rank * local_width, (self.rank + 1) * local_width)

    def _mamba_slices(self, pre: str, mod: Mamba2Mixer, out: dict[str, Slices]) -> None:
        m = self.config.mamba
        i, n, p = m.intermediate_size, m.d_state, m.head_dim
        gn = m.n_groups * n
        h0, h1 = self.mamba_heads
        g0, g1 = self.mamba_groups
        x = (h0 * p, h1 * p)
        b = (g0 * n, g1 * n)
        conv = ((x[0], x[1]), (i + b[0], i + b[1]), (i + gn + b[0], i + gn + b[1]))
        in_rows = ((x[0], x[1]),) + tuple((i + lo, i + hi) for lo, hi in conv) + (
            (2 * i + 2 * gn + h0, 2 * i + 2 * gn + h1),
        )
        out[f"{pre}in_proj.weight"] = (0, in_rows)
        if m.proj_bias:
            out[f"{pre}in_proj.bias"] = (0, in_rows)
        out[f"{pre}conv1d.weight"] = (0, conv)
        if m.conv_bias:
            out[f"{pre}conv1d.bias"] = (0, conv)
        for name in ("dt_bias", "A_log", "D"):
            out[f"{pre}{name}"] = (0, ((h0, h1),))
        out[f"{pre}norm.weight"] = (0, (x,))
        out[f"{pre}out_proj.weight"] = (1, (x,))

    # ---- the modules that talk to the other ranks ------------------------------------

    def install(self, model: nn.Module, group) -> None:
        """Swap the row-parallel projections, the spanning norms and the LM head of
        ``model`` (built from :attr:`local`, parameters unloaded) for their
        tensor-parallel versions, keeping every weight name."""
        for mod in list(model.modules()):
            if isinstance(mod, Mamba2Mixer):
                mod.out_proj = RowParallelLinear.like(mod.out_proj, group)
                if self.norm_spans_ranks:
                    m = self.config.mamba
                    mod.norm = SpanningGatedRMSNorm(
                        mod.norm.weight.shape[0], m.n_groups, self.mamba_groups[0],
                        m.intermediate_size // m.n_groups, m.norm_eps, group,
                    )
            elif isinstance(mod, GatedDeltaNet):
                mod.out_proj = RowParallelLinear.like(mod.out_proj, group)
            elif isinstance(mod, Attention):
                mod.o_proj = RowParallelLinear.like(mod.o_proj, group)
            elif isinstance(mod, MoEBlock):
                p = self.local.moe
                experts = ColumnParallelExperts(p.latent_size or self.config.hidden_size, p)
                experts.kernels = mod.experts.kernels
                experts.group = group
                mod.experts = experts
            elif isinstance(mod, FusedGatedMLP):
                mod.output_linear = RowParallelLinear.like(mod.output_linear, group)
            elif isinstance(mod, (GatedMLP, PlainMLP)):
                mod.down_proj = RowParallelLinear.like(mod.down_proj, group)
        if model.lm_head is not None:
            model.lm_head = VocabParallelHead(
                self.config.hidden_size, self.vocab_padded, self.config.vocab_size, group
            )


class RowParallelLinear(nn.Linear):
    """A projection whose input columns are split over the ranks: each rank multiplies its
    columns, the partial products are summed over the ranks, and the bias (held whole by
    every rank) is added once, after the sum, so every rank gets the same output."""

    group = None

    @classmethod
    def like(cls, linear: nn.Linear, group) -> RowParallelLinear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype)
        new.group = group
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ColumnParallelExperts(Experts):
    """Routed experts holding this rank's columns of every expert: the router is
    replicated (every rank picks the same experts for a token, from the same inputs and
    weights), each rank computes its columns' share of the chosen experts' outputs, and
    the shares are summed over the ranks. In a latent mixture the sum is taken in the
    latent space, before the replicated ``fc2_latent_proj``; a shared expert is a
    column-parallel MLP with its own row-parallel down projection."""

    group = None
    takes_add = False  # a share of the sum: the block adds the shared expert after

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x, topk_ids, topk_weights))


class VocabParallelHead(nn.Module):
    """The LM head's rows ``[r P, (r+1) P)`` of ``V`` (``P = ceil(V / tp)``, the last
    rank's shard zero-padded): ``hidden [N, hidden] -> logits [N, V]`` on every rank
    (each rank's ``[N, P]`` all-gathered)."""

    def __init__(self, hidden_size: int, rows: int, vocab_size: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(F.linear(hidden, self.weight))
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


class SpanningGatedRMSNorm(GatedRMSNorm):
    """The Mamba2 gated norm when its group spans ranks: this rank holds ``hidden_size``
    channels of global group ``group_index`` (of ``n_groups``, each ``group_width``
    channels). Every rank puts its partial sum of squares in its group's column of a
    ``[T, n_groups]`` tensor and the ranks all-reduce it, so each group's mean square is
    over all of its channels, as in the reference (whose ``mean`` over the group this
    computes as the reduced sum divided by the group's width)."""

    def __init__(
        self, hidden_size: int, n_groups: int, group_index: int, group_width: int,
        eps: float, group,
    ) -> None:
        super().__init__(hidden_size, 1, eps, "reference")
        self.global_groups = n_groups
        self.group_index = group_index
        self.group_width = group_width
        self.group = group

    def forward(
        self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        sums = torch.zeros(*h.shape[:-1], self.global_groups, dtype=h.dtype, device=h.device)
        sums[..., self.group_index] = h.pow(2).sum(-1)
        self.group.all_reduce(sums)
        mean = sums[..., self.group_index : self.group_index + 1] / self.group_width
        y = self.weight * (h * torch.rsqrt(mean + self.eps)).to(dtype)
        return y if out_dtype is None else y.to(out_dtype)


# ---- loading ---------------------------------------------------------------------------


def _read(f, name: str, spec: Slices | None) -> torch.Tensor:
    if spec is None:
        return f.get_tensor(name)
    dim, ranges = spec
    sl = f.get_slice(name)
    index = {0: lambda lo, hi: sl[lo:hi], 1: lambda lo, hi: sl[:, lo:hi],
             2: lambda lo, hi: sl[:, :, lo:hi]}[dim]
    parts = [index(lo, hi) for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _expert_into(f, disk_name, slot, spec: Slices, state, local_shapes, device, dtype, file):
    """One expert's checkpoint tensor (a per-expert ``gate_proj`` / ``up_proj`` /
    ``down_proj``) into this rank's stacked parameter: its columns only. Returns the
    bytes read."""
    dim, ranges = spec
    dest = state.get(slot.param)
    if dest is None:
        dest = torch.empty(local_shapes[slot.param], dtype=dtype, device=device)
        state[slot.param] = dest
    sl = f.get_slice(disk_name)
    if dim == 2:  # down_proj [H, I]: this rank's columns
        (a, b), = ranges
        t = sl[:, a:b]
        dest[slot.expert].copy_(loader._finite(file, disk_name, t, device, dtype))
        return t.nbytes
    # gate_up_proj rows (gate half or up half, as slot.rows says) or up_proj rows.
    a, b = ranges[0]
    width = b - a
    at = 0 if slot.rows is None or slot.rows[0] == 0 else width
    t = sl[a:b]
    dest[slot.expert, at : at + width].copy_(loader._finite(file, disk_name, t, device, dtype))
    return t.nbytes


def load_model_shard(
    path: str | Path,
    group,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    policy: KernelPolicy | None = None,
) -> nn.Module:
    """Rank ``group.rank``'s model of the checkpoint at ``path``: built from its
    :class:`ShardLayout`, every weight checked against the full config's shapes as
    :func:`~hybridserve.models.loader.load_model` checks them, and only this rank's
    slices read (memory-mapped). The model carries ``shard_layout`` and ``load_stats``
    (bytes actually read by this rank)."""
    started = time.perf_counter()
    path = Path(path)
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_pretrained(path)
    layout = ShardLayout.of(config, group.rank, group.world_size)
    cls = model_class(config.architecture)
    files = loader.checkpoint_files(path)
    where = path / loader.INDEX_FILE if (path / loader.INDEX_FILE).exists() else path / loader.SINGLE_FILE
    with torch.device("meta"):
        full = cls(config, policy)
        model = cls(layout.local, policy)
    full_shapes = {name: tuple(t.shape) for name, t in full.state_dict().items()}
    del full
    slots, unexpected, _ = loader._slots(cls, config, files, full_shapes)
    loader.check_coverage(slots, full_shapes, where, config.architecture)
    if unexpected:
        raise loader.CheckpointError(
            f"{files[unexpected[0]]}: unexpected weight(s) {unexpected[:5]}, unknown to "
            f"{config.architecture} with this config.json"
        )
    with torch.device("meta"):
        layout.install(model, group)
    specs = layout.slices(model)
    local_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    by_file: dict[Path, list[tuple[str, object]]] = {}
    for disk_name, (file, slot) in slots.items():
        by_file.setdefault(file, []).append((disk_name, slot))
    state: dict[str, torch.Tensor] = {}
    nbytes = 0
    lo, hi = layout.vocab_rows

    def dtype_of(param: str) -> torch.dtype:
        return torch.float32 if param.rsplit(".", 1)[-1] in FLOAT32_WEIGHTS else dtype

    with torch.no_grad():
        for file, names in by_file.items():
            with loader.safe_open(str(file), framework="pt", device="cpu") as f:
                for disk_name, slot in names:
                    param = slot.param
                    shape = tuple(f.get_slice(disk_name).get_shape())
                    full = full_shapes[param]
                    want = full if slot.expert is None else full[1:]
                    if slot.rows is not None:
                        want = (slot.rows[1] - slot.rows[0], *want[1:])
                    if shape != want:
                        raise loader.CheckpointError(
                            f"{file}: weight {disk_name!r} has shape {list(shape)}, expected "
                            f"{list(want)} from config.json"
                        )
                    if param == "lm_head.weight":
                        t = f.get_slice(disk_name)[lo:hi]
                    elif slot.expert is None:
                        t = _read(f, disk_name, specs.get(param))
                    else:
                        nbytes += _expert_into(f, disk_name, slot, specs[param], state,
                                               local_shapes, device, dtype_of(param), file)
                        continue
                    nbytes += t.nbytes
                    state[param] = loader._finite(file, disk_name, t, device, dtype_of(param))
        if config.tie_word_embeddings:
            # The tied head is this rank's rows of the (replicated) embedding.
            with torch.device("meta"):
                model.lm_head = VocabParallelHead(
                    config.hidden_size, layout.vocab_padded, config.vocab_size, group
                )
            state["lm_head.weight"] = state[f"model.{cls.names.embed}.weight"][lo:hi]
        head = state["lm_head.weight"]
        if head.shape[0] < layout.vocab_padded:
            pad = head.new_zeros(layout.vocab_padded - head.shape[0], head.shape[1])
            state["lm_head.weight"] = torch.cat([head, pad])
        local_shapes["lm_head.weight"] = (layout.vocab_padded, config.hidden_size)
        for name, t in state.items():
            if tuple(t.shape) != local_shapes[name]:
                raise loader.CheckpointError(
                    f"{where}: rank {group.rank}'s slice of {name!r} has shape {list(t.shape)}, "
                    f"expected {list(local_shapes[name])}"
                )
        model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.checkpoint_path = path
    model.shard_layout = layout
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    model.load_stats = loader.LoadStats(nbytes, len(by_file), time.perf_counter() - started)
    return model.eval()
