"""Token sampling, speculative verification and logprobs, batched in torch ops.

One step, one draw, one read-back. :func:`plan_draw` builds on the host, once per
step, the per-position parameters of every sampling position (temperature, top-k,
top-p, min-p, the request's ``sample_seed``, the generated-token index of the
position, the penalties and the tokens they apply to, which positions want logprobs)
as one float64 buffer, sent to the device in one transfer. :func:`sample_step` then
processes and draws every position of the step at once on the logits' device and
returns one int64 tensor: the target's token after each position, followed by the
logprobs payload of the positions whose request asks for logprobs. The host reads it
back once and :func:`read_step` decodes it. The same code runs on CPU and CUDA, except
that on CUDA (``KernelPolicy.sampler`` "auto"; "triton" on any device) the sampled draw of :func:`draw` and
:func:`draft_draw` is one Triton pass over the vocabulary
(:func:`hybridserve.kernels.sampling.draw`, the same tokens, without the ``[positions x
vocab]`` uniform and key tables); the torch code here is its twin.

Processing: the definitions of :func:`process_logits` (the per-row reference), row by
row with each row's own values: the logit bias, repetition penalty over the prompt and output tokens,
presence / frequency penalties over the output tokens, then temperature, top-k, top-p
(the smallest prefix of the sorted distribution whose mass reaches ``top_p``, always
keeping the top token) and min-p. Greedy positions (temperature 0) take the argmax of
the log-softmax of the penalised logits, so ties resolve as in :func:`argmax_ids`.

Randomness is counter based (:func:`uniforms`): every ``(sample_seed, index, token)``
has its own uniform ``u`` in (0, 1), an integer hash of the three, and a sampled
position draws ``argmax_t logp(t) - log(-log u(t))`` (the Gumbel-max trick, i.e. the
exponential race), an exact sample from ``exp(logp)``. A draw depends on nothing but
the request's seed, the index of the token being generated and the processed
distribution: not on the batch around the request, its row in the batch, preemption
and recompute, the step layout, or which path computed the distribution's
adjustments. So a seeded request samples the same tokens whatever the batch around it,
after preemption and recompute, and in any step layout; asking for logprobs never
changes its tokens.

Speculative verification of point-mass drafts (an n-gram proposer's) is coupled to that
draw: the target's token at draft position j is drawn as above, and the draft ``x`` is
accepted iff it is that token. Acceptance has probability ``p_j(x)`` (the most any
verification of a point-mass draft can accept), and a rejected position emits the
drawn token, which given "not x" is distributed as ``p_j`` with ``x`` removed and
renormalised: the residual ``max(p - q, 0)`` for ``q`` a point mass. Every emitted
token is therefore distributed exactly as the target's sampling; beyond that, a seeded
request emits the same tokens with or without speculation. The host's walk over a
row's positions is :func:`verify_choices`, for greedy and sampled rows alike.

Structured outputs: a row whose request is constrained (``SampleRow.grammar``) gets,
for each of its positions, the bitmask of the tokens its grammar allows after the
row's committed output plus the drafts before that position, filled on the host by
the row's matcher in :func:`plan_draw` and carried in the same float64 buffer as the
other parameters (two int32 mask words per float64 slot, their bits untouched), so the
step still makes one upload. :func:`process_step` sets the disallowed tokens' logits to
``-inf`` before anything else; rows without a grammar are not touched, and a step
without constrained rows does no mask work at all. Drafts reach the sampler already
cut to the prefix the grammar accepts (the engine checks them), so every position's
mask is defined, and the token emitted at any position is one its mask allows. A
replayed decode graph (:mod:`hybridserve.runner.cuda_graph`) takes the same masks from
a static buffer of every position's mask instead (:func:`fill_masks`, all ones where
nothing is masked) and applies them to every row (:func:`apply_dense_bitmasks`): the
same values at the masked positions, the others unchanged.

Logprobs are the model's raw distribution (log-softmax of the logits before
penalties, temperature and truncation), as vLLM reports them by default.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridserve.config import KERNEL_MODES, runs_triton
from hybridserve.kernels import sampling as sampling_kernels
from hybridserve.step import Logprob, SamplingParams
from hybridserve.structured.backend import GrammarMatcher, bitmask_words, fill_step_bitmasks

# --- the counter-based RNG ---------------------------------------------------------
#
# All arithmetic is on int64 tensors holding values in [0, 2^31): an odd multiplier
# below 2^30 keeps every product under 2^61, so nothing overflows int64 and the same
# integer ops give the same bits on every device. ``_mix`` is a bijection of
# [0, 2^31) (xor with a right shift of itself is invertible, and so is multiplication
# by an odd number modulo 2^31) built like MurmurHash3's finalizer: the multiplies
# carry low bits upwards, the shifts fold high bits back down.
#
# A position's seed words and index are absorbed into three round keys (a chain of
# ``_mix(h ^ word)``), and a token's value is three keyed rounds ``h = _mix(h ^ key)``
# starting from the token id. Each round is a bijection of the token id for fixed keys,
# so the tokens of one position never share a value; two positions whose first keys
# happen to be close still part at the next key. Nothing in it depends on any other
# position, which is what makes draws batch invariant.

_MASK31 = (1 << 31) - 1
_MUL_A = 0x2C1B3C6D
_MUL_B = 0x297A2D39
_KEY_SALTS = (0x3C6EF372, 0x1B873593, 0x68E31DA4)


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * _MUL_A) & _MASK31
    h = h ^ (h >> 15)
    h = (h * _MUL_B) & _MASK31
    return h ^ (h >> 16)


def seed_words(sample_seed: int | None) -> tuple[int, int]:
    """The two 31-bit words a seed enters the hash as (seeds equal modulo 2^62 share a
    stream; the engine draws its own seeds below 2^62)."""
    s = (sample_seed or 0) % (1 << 62)
    return s & _MASK31, s >> 31


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u[i, t]`` in (0, 1), float64: the uniform of token ``t`` at the position with
    seed words ``(seed_lo[i], seed_hi[i])`` and generated-token index ``index[i]``
    (int64 tensors ``[N]``, words from :func:`seed_words`). Odd multiples of 2^-32, so
    neither 0 nor 1."""
    h = torch.arange(vocab, dtype=torch.int64, device=seed_lo.device)[None, :]
    return _token_uniforms(h, _position_keys(seed_lo, seed_hi, index))


def uniforms_at(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """``uniforms(seed_lo, seed_hi, index, vocab).gather(1, tokens)`` without the
    ``[N, vocab]`` table: the uniforms of the tokens ``tokens [N, m]`` (int64) only.
    Bit-identical, since a token's value depends on nothing but its id and the keys."""
    return _token_uniforms(tokens.long(), _position_keys(seed_lo, seed_hi, index))


def _position_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor) -> tuple:
    """The three round keys ``[N]`` of positions with these seed words and indices."""
    k1 = _mix(_mix(_mix(seed_lo ^ _KEY_SALTS[0]) ^ seed_hi) ^ (index & _MASK31))
    k2 = _mix(k1 ^ _KEY_SALTS[1])
    return k1, k2, _mix(k2 ^ _KEY_SALTS[2])


def _token_uniforms(h: torch.Tensor, keys: tuple) -> torch.Tensor:
    """Three keyed rounds over token ids ``h`` (a row per key), as uniforms in (0, 1)."""
    for key in keys:
        h = _mix(h ^ key[:, None])
    return (h.double() * 2 + 1) * 2.0**-32


def draw(
    logp: torch.Tensor,
    greedy: torch.Tensor,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    index: torch.Tensor,
    any_sampled: bool = True,
    kernels: str = "auto",
) -> torch.Tensor:
    """One token per row of processed log-probabilities ``logp [N, vocab]`` -> ``[N]``.

    Rows where ``greedy`` is True take the argmax; the others an exact sample by the
    Gumbel-max trick over :func:`uniforms`. ``any_sampled=False`` (the caller knows no
    row samples) skips the noise.

    ``kernels`` (``KernelPolicy.sampler``): where a sampled draw runs as the one-pass
    kernel :func:`hybridserve.kernels.sampling.draw` (same tokens, no ``[N, vocab]``
    tables): ``"triton"`` everywhere (the CPU interpreter too), ``"auto"`` on CUDA,
    ``"reference"`` nowhere. The torch code below is its twin and the CPU path.
    """
    if any_sampled and _sampler_kernel(kernels, logp):
        return sampling_kernels.draw(logp, greedy, seed_lo, seed_hi, index)
    choice = torch.argmax(logp, dim=-1)
    if not any_sampled:
        return choice
    u = uniforms(seed_lo, seed_hi, index, logp.shape[-1])
    # -log(u) is an Exp(1) variate; argmax of logp - log(E) = argmin of E / p: the token
    # whose exponential clock rings first, with rate p. float64 so u's 31 bits survive.
    keys = logp.double() - torch.log(-torch.log(u))
    return torch.where(greedy, choice, torch.argmax(keys, dim=-1))


def _sampler_kernel(kernels: str, logp: torch.Tensor, *more: torch.Tensor) -> bool:
    """Whether a draw over ``logp`` (and ``more`` rows beside it) takes the Triton
    kernel under ``kernels``."""
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernel_policy.sampler={kernels!r}: choose from {KERNEL_MODES}")
    return runs_triton(kernels, logp.device)


# --- per-row reference definitions --------------------------------------------------


def process_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """Apply penalties, temperature and top-k / top-p / min-p to one row of logits.

    Returns float32 log-probabilities of the distribution to sample from (``-inf`` for
    excluded tokens). The ``logit_bias`` is added first (after token masks, which this
    reference leaves to :func:`apply_bitmasks`), then penalties, as vLLM orders them.
    For greedy requests only the bias and penalties apply and the result's argmax is
    the choice. The definition that :func:`sample_step` batches.
    """
    x = logits.float().clone()
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < x.numel()]
        x[ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=torch.float32)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if seen.numel():
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(list(output_ids), dtype=torch.long).unique(return_counts=True)
        x[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty
    if params.greedy:
        return torch.log_softmax(x, dim=-1)
    x = x / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(logp, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        drop_sorted = (cum - sorted_lp.exp()) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    if params.min_p > 0.0:
        probs = logp.exp()
        drop = probs < params.min_p * probs.max()
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def samples_by_argmax(params: SamplingParams) -> bool:
    """True when the token after any position is the plain argmax of the raw logits.

    Greedy with no penalty and no logprobs: :func:`process_logits` is then a
    log-softmax (order preserving) and nothing else of the row's logits is needed, so
    a step made only of such rows needs nothing but :func:`argmax_ids`.
    """
    return params.greedy and params.logprobs is None and params.plain_logits


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """Device-side greedy choice for every row of ``logits [N, vocab]`` -> ``[N]`` int64.

    Same value as ``argmax(process_logits(row))`` for a greedy request without penalties:
    the argmax is taken over the log-softmax, as on the general path, so ties resolve
    identically.
    """
    return torch.argmax(torch.log_softmax(logits.float(), dim=-1), dim=-1)


def verify_choices(choices: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Walk a row's positions: ``choices[j]`` is the target's token after draft position
    j (``len(drafts) + 1`` entries, from :func:`draw`). Returns the drafts accepted (each
    equal to the choice at its position) and then the first choice that differs from
    its draft, or the last choice when every draft is accepted."""
    out: list[int] = []
    for j, x in enumerate(drafts):
        if choices[j] != x:
            out.append(int(choices[j]))
            return out
        out.append(x)
    out.append(int(choices[len(drafts)]))
    return out


def verify_drafts(
    logps: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    sample_seed: int | None,
    first_index: int,
) -> list[int]:
    """Speculative verification of point-mass drafts (an n-gram proposer's).

    ``logps[j]`` is the processed distribution for the token after draft position j
    (row 0 follows the last accepted token), ``len(logps) == len(drafts) + 1``; position
    j generates token ``first_index + j`` of the request. Returns the accepted drafts
    followed by one token from the target model, so 1 <= len(result) <= len(drafts) + 1.

    Greedy: accept while the draft equals the argmax. Sampling: the target's token at
    each position is drawn with the request's counter-based noise and the draft is
    accepted iff it equals it, i.e. with probability p(x); a rejection emits the drawn
    token, distributed as p with x removed and renormalised (see the module
    docstring). Every emitted token is distributed exactly as the target's sampling,
    and this is the draw :func:`sample_step` makes on the device.
    """
    n = len(drafts) + 1
    lo, hi = seed_words(sample_seed)
    full = torch.full((n,), 1, dtype=torch.int64)
    choices = draw(
        logps[:n].float(),
        torch.full((n,), params.greedy),
        full * lo,
        full * hi,
        torch.arange(first_index, first_index + n, dtype=torch.int64),
        any_sampled=not params.greedy,
    )
    return verify_choices(choices.tolist(), drafts)


def token_logprobs(raw_logits: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The ``k`` most likely tokens and ``token`` itself, with 1-based ranks (the per-row
    reference of the payload :func:`sample_step` computes)."""
    logp = torch.log_softmax(raw_logits.float(), dim=-1)
    out: dict[int, Logprob] = {}
    if k > 0:
        top = torch.topk(logp, k)
        for rank, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            out[i] = Logprob(logprob=v, rank=rank)
    if token not in out:
        v = float(logp[token])
        rank = int((logp > logp[token]).sum()) + 1
        out[token] = Logprob(logprob=v, rank=rank)
    return out


# --- one step, batched --------------------------------------------------------------


@dataclass
class SampleRow:
    """One sampling row of a step: ``len(drafts) + 1`` positions, the j-th generating
    token ``first_index + j`` of the request, after ``output_ids + drafts[:j]``.
    ``grammar``: the sequence's matcher when its request is constrained (the drafts
    must be a prefix it accepts)."""

    params: SamplingParams
    sample_seed: int | None
    first_index: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    drafts: Sequence[int]
    grammar: GrammarMatcher | None = None
    eos_token_ids: Sequence[int] = ()  # banned with stop_token_ids before min_tokens

    @classmethod
    def of(cls, row) -> SampleRow:
        """The sampling row of a scheduled row (``row.request``, ``row.num_drafts``):
        its request's parameters, sequence and grammar, its first position generating
        the token after the request's committed output."""
        req = row.request
        return cls(
            params=req.params,
            sample_seed=req.sample_seed,
            first_index=len(req.output_token_ids),
            prompt_ids=req.prompt_token_ids,
            output_ids=req.output_token_ids,
            drafts=req.draft_token_ids[: row.num_drafts],
            grammar=req.grammar,
            eos_token_ids=() if req.params.ignore_eos else req.eos_token_ids,
        )


# Columns of the per-position parameter block of the packed buffer.
PARAM_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seed_lo", "seed_hi", "index",
                 "repetition", "presence", "frequency")
_COLS = PARAM_COLUMNS
_C = {name: i for i, name in enumerate(_COLS)}


def active_top_k(params: SamplingParams, vocab_size: int) -> int:
    """The top-k a position of ``params`` applies (0: none; greedy positions are not
    truncated: :func:`process_logits` returns before truncating)."""
    return params.top_k if not params.greedy and 0 < params.top_k < vocab_size else 0


def active_top_p(params: SamplingParams) -> float:
    return 1.0 if params.greedy else params.top_p


def active_min_p(params: SamplingParams) -> float:
    return 0.0 if params.greedy else params.min_p


def graph_samplable(params: SamplingParams) -> bool:
    """Whether a row of ``params`` can be drawn inside a replayed decode graph: no
    penalties or biases and no logprobs (their inputs and outputs vary in size from step
    to step). Token masks (a grammar's, ``allowed_token_ids``, ``min_tokens``) have a
    fixed size and go into the graph's static mask buffer (:func:`fill_masks`)."""
    return (
        params.logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and params.logit_bias is None
    )


def needs_mask(params: SamplingParams, grammar: object | None) -> bool:
    """Whether a row's draw masks tokens: it has a grammar (``grammar``: the sequence's
    matcher, None while a grammar waits for its start tag) or ``allowed_token_ids`` /
    ``min_tokens``."""
    return grammar is not None or params.token_masked


def position_params(
    params: SamplingParams, sample_seed: int | None, first_index: int, count: int, vocab_size: int
) -> np.ndarray:
    """``[count, len(PARAM_COLUMNS)]`` float64: the parameter columns of a row's
    ``count`` consecutive positions, generated-token indices from ``first_index``."""
    lo, hi = seed_words(sample_seed)
    out = np.empty((count, len(_COLS)), dtype=np.float64)
    out[:] = (
        params.temperature, active_top_k(params, vocab_size), active_top_p(params),
        active_min_p(params), lo, hi, 0, params.repetition_penalty,
        params.presence_penalty, params.frequency_penalty,
    )
    out[:, _C["index"]] = np.arange(first_index, first_index + count)
    return out


@dataclass
class DrawPlan:
    """The host's description of one step's sampling (:func:`plan_draw`).

    ``packed``: one float64 host buffer (every value in it is an integer below 2^53 or
    a float64 parameter, so nothing rounds): ``[num_positions, len(_COLS)]`` parameters,
    then ``num_penalties`` triples ``(position, token, count in the output)`` naming the
    tokens a penalty touches, then ``num_biases`` triples ``(position, token, bias)``
    of the rows' ``logit_bias``, then the logprob positions, then the ``num_masked``
    constrained positions and their bitmasks (``mask_words`` int32 words each, two to a
    float64 slot). The flags are known on the host and spare the device work no
    position needs.
    """

    packed: torch.Tensor
    num_positions: int
    num_penalties: int
    logprob_positions: list[int]
    logprob_k: list[int]  # per logprob position: the request's ``logprobs``
    max_logprobs: int  # top tokens computed per logprob position (<= vocab)
    max_top_k: int  # the largest active top-k (0: none)
    any_sampled: bool
    any_top_p: bool
    any_min_p: bool
    num_masked: int = 0
    mask_words: int = 0
    num_biases: int = 0

    @property
    def bias_start(self) -> int:
        """Offset in ``packed`` of the logit-bias triples."""
        return self.num_positions * len(_COLS) + 3 * self.num_penalties

    @property
    def logprob_start(self) -> int:
        """Offset in ``packed`` of the logprob positions."""
        return self.bias_start + 3 * self.num_biases

    @property
    def mask_start(self) -> int:
        """Offset in ``packed`` of the constrained positions (their masks follow)."""
        return self.logprob_start + len(self.logprob_positions)

    @property
    def payload_width(self) -> int:
        """int64 entries per logprob position: top values, top ids, the token's logprob
        and its rank."""
        return 2 * self.max_logprobs + 2


def plan_draw(rows: Sequence[SampleRow], vocab_size: int) -> DrawPlan:
    """Build the per-position parameters of a step's sampling rows (in position order:
    the rows' positions are consecutive rows of the logits that :func:`sample_step`
    gets)."""
    params_rows: list[list[float]] = []
    penalties: list[tuple[int, int, int]] = []
    biases: list[tuple[int, int, float]] = []
    lp_pos: list[int] = []
    lp_k: list[int] = []
    max_top_k = 0
    any_sampled = any_top_p = any_min_p = False
    masked_pos: list[int] = []
    masked_rows: list[SampleRow] = []
    words = bitmask_words(vocab_size)
    for row in rows:
        if row.grammar is not None and row.grammar.words != words:
            raise ValueError(
                f"the grammar's vocabulary ({row.grammar.vocab_size}) is not the logits' ({vocab_size})"
            )
        if row.grammar is not None or row.params.token_masked:
            masked_pos += range(len(params_rows), len(params_rows) + len(row.drafts) + 1)
            masked_rows.append(row)
        p = row.params
        lo, hi = seed_words(row.sample_seed)
        greedy = p.greedy
        top_k = active_top_k(p, vocab_size)
        top_p = active_top_p(p)
        min_p = active_min_p(p)
        any_sampled |= not greedy
        any_top_p |= top_p < 1.0
        any_min_p |= min_p > 0.0
        max_top_k = max(max_top_k, top_k)
        repetition = p.repetition_penalty != 1.0
        counted = bool(p.presence_penalty or p.frequency_penalty)
        prompt_set = set(row.prompt_ids) if repetition else set()
        counts = Counter(row.output_ids)
        for j in range(len(row.drafts) + 1):
            pos = len(params_rows)
            if j:
                counts[row.drafts[j - 1]] += 1
            params_rows.append([
                p.temperature, top_k, top_p, min_p, lo, hi, row.first_index + j,
                p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            ])
            if repetition or (counted and counts):
                touched = (prompt_set | counts.keys()) if repetition else counts.keys()
                penalties += [(pos, t, counts.get(t, 0)) for t in sorted(touched)]
            if p.logit_bias:
                biases += [(pos, t, b) for t, b in p.logit_bias.items() if t < vocab_size]
            if p.logprobs is not None:
                lp_pos.append(pos)
                lp_k.append(p.logprobs)
    flat = [v for r in params_rows for v in r]
    flat += [v for e in penalties for v in e]
    flat += [v for e in biases for v in e]
    flat += lp_pos
    flat += masked_pos
    if masked_rows:
        # The mask words ride in the float64 buffer as raw bits, two per slot, filled
        # in place by the matchers.
        mask_slots = -(-len(masked_pos) * words // 2)
        buf = np.zeros(len(flat) + mask_slots, dtype=np.float64)
        buf[: len(flat)] = flat
        tail = buf[len(flat):].view(np.int32)
        masks = tail[: len(masked_pos) * words].reshape(len(masked_pos), words)
        fill_masks(masked_rows, masks, vocab_size)
        packed = torch.from_numpy(buf)
    else:
        packed = torch.tensor(flat, dtype=torch.float64)
    return DrawPlan(
        packed=packed,
        num_positions=len(params_rows),
        num_penalties=len(penalties),
        logprob_positions=lp_pos,
        logprob_k=lp_k,
        max_logprobs=min(max(lp_k, default=0), vocab_size),
        max_top_k=max_top_k,
        any_sampled=any_sampled,
        any_top_p=any_top_p,
        any_min_p=any_min_p,
        num_masked=len(masked_pos),
        mask_words=words if masked_rows else 0,
        num_biases=len(biases),
    )


def _token_bits(ids: Sequence[int], words: int) -> np.ndarray:
    """The int32 bitmask words with the bits of ``ids`` set."""
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[np.asarray(list(ids), dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def fill_masks(
    rows: Sequence[SampleRow], out: np.ndarray, vocab_size: int, starts: Sequence[int] | None = None
) -> None:
    """The token masks of masked rows (:func:`needs_mask`): row ``k``'s
    ``len(drafts) + 1`` positions are rows ``starts[k] ...`` of ``out`` (int32
    ``[positions, words]``, C-contiguous; consecutive from 0 without ``starts``). A
    grammar row's masks come from its matcher, the others start with every token
    allowed; then every row's ``allowed_token_ids`` applies and, before its
    ``min_tokens``, EOS and ``stop_token_ids`` are taken out. Rows of ``out`` that no
    row names are left as they are."""
    words = out.shape[1]
    if starts is None:
        starts, at = [], 0
        for row in rows:
            starts.append(at)
            at += len(row.drafts) + 1
    grammar_rows, grammar_starts = [], []
    for row, at in zip(rows, starts):
        if row.grammar is not None:
            grammar_rows.append((row.grammar, row.drafts))
            grammar_starts.append(at)
        else:
            out[at : at + len(row.drafts) + 1] = -1
    if grammar_rows:
        fill_step_bitmasks(grammar_rows, out, grammar_starts)
    for row, at in zip(rows, starts):
        p = row.params
        if not p.token_masked:
            continue
        n = len(row.drafts) + 1
        if p.allowed_token_ids is not None:
            out[at : at + n] &= _token_bits([t for t in p.allowed_token_ids if t < vocab_size], words)
        if p.min_tokens:
            banned = [t for t in (*row.eos_token_ids, *(p.stop_token_ids or ())) if t < vocab_size]
            if banned:
                ban = ~_token_bits(banned, words)
                for j in range(n):
                    if row.first_index + j < p.min_tokens:
                        out[at + j] &= ban


def _columns(plan: DrawPlan, packed: torch.Tensor) -> torch.Tensor:
    n = plan.num_positions
    return packed[: n * len(_COLS)].view(n, len(_COLS))


def process_step(logits: torch.Tensor, plan: DrawPlan, packed: torch.Tensor) -> torch.Tensor:
    """:func:`process_logits` for every position of a step at once: ``logits
    [num_positions, vocab]`` raw, ``packed`` the plan's buffer on the logits' device.
    Returns the float32 log-probabilities to draw from."""
    n, ncol = plan.num_positions, len(_COLS)
    cols = _columns(plan, packed)
    temperature = cols[:, _C["temperature"]].float()
    greedy = temperature == 0
    x = logits.float()
    if plan.num_masked:
        x = apply_bitmasks(x, plan, packed)
    if plan.num_biases:
        start = plan.bias_start
        ent = packed[start : start + 3 * plan.num_biases].view(-1, 3)
        # Out of place, like the penalties below.
        x = x.index_put((ent[:, 0].long(), ent[:, 1].long()), ent[:, 2].float(), accumulate=True)
    if plan.num_penalties:
        ent = packed[n * ncol : n * ncol + 3 * plan.num_penalties].view(-1, 3).long()
        pos, tok, count = ent[:, 0], ent[:, 1], ent[:, 2]
        vals = x[pos, tok]
        rep = cols[:, _C["repetition"]].float()[pos]
        vals = torch.where(rep != 1.0, torch.where(vals > 0, vals / rep, vals * rep), vals)
        presence = cols[:, _C["presence"]].float()[pos]
        frequency = cols[:, _C["frequency"]].float()[pos]
        counted = (count > 0) & ((presence != 0) | (frequency != 0))
        vals = torch.where(counted, vals - (frequency * count.float() + presence), vals)
        # Out of place: ``logits.float()`` may be ``logits`` itself.
        x = x.index_put((pos, tok), vals)
    if plan.any_sampled:
        x = x / torch.where(greedy, 1.0, temperature)[:, None]
    if plan.max_top_k:
        top_k = cols[:, _C["top_k"]].long()
        kth = torch.topk(x, plan.max_top_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        x = x.masked_fill((top_k > 0)[:, None] & (x < kth), float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    if plan.any_top_p:
        top_p = cols[:, _C["top_p"]].float()
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        sorted_p = sorted_lp.exp()
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        cut = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
        logp = torch.where((top_p < 1.0)[:, None], cut, logp)
    if plan.any_min_p:
        min_p = cols[:, _C["min_p"]].float()
        probs = logp.exp()
        drop = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        cut = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
        logp = torch.where((min_p > 0.0)[:, None], cut, logp)
    return logp


def token_allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[m, vocab]`` bool: bit ``t % 32`` of word ``t // 32`` of each row of ``bits``
    (int32 ``[m, words]``)."""
    tok = torch.arange(vocab, device=bits.device)
    return ((bits[:, tok // 32] >> (tok % 32)) & 1).bool()


def apply_bitmasks(x: torch.Tensor, plan: DrawPlan, packed: torch.Tensor) -> torch.Tensor:
    """``x`` with the tokens each constrained position's bitmask excludes set to
    ``-inf`` (out of place; other rows unchanged)."""
    m, w = plan.num_masked, plan.mask_words
    start = plan.mask_start
    pos = packed[start : start + m].long()
    slots = -(-m * w // 2)
    bits = packed[start + m : start + m + slots].view(torch.int32)[: m * w].view(m, w)
    return x.index_put((pos,), x[pos].masked_fill(~token_allowed(bits, x.shape[-1]), float("-inf")))


def apply_dense_bitmasks(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``x [N, vocab]`` with the tokens row ``i`` of ``bits`` (int32 ``[N, words]``)
    excludes set to ``-inf``: every row masked, a row of all ones leaves its row as it
    is (a decode graph's draw, whose mask buffer has every position's mask). Gives the
    values :func:`apply_bitmasks` gives at the positions it masks."""
    return x.masked_fill(~token_allowed(bits, x.shape[-1]), float("-inf"))


def sample_step(
    logits: torch.Tensor,
    plan: DrawPlan,
    packed: torch.Tensor,
    drafted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kernels: str = "auto",
) -> torch.Tensor:
    """Sample every position of a step: ``logits [num_positions, vocab]`` (raw),
    ``packed`` the plan's buffer on the logits' device. Returns int64 on that device:
    the chosen token per position, then ``payload_width`` entries per logprob position
    (float32 values travel as their bit patterns). Reads nothing back to the host.

    ``drafted``: ``(positions [M], logq [M, vocab], drafts [M], use)`` for draft
    positions whose drafter sampled from a distribution ``q`` of its own: their choice
    is :func:`speculative_choices` instead of the point-mass coupling of :func:`draw`.
    ``use`` (bool ``[M]``, or None for all): which of the ``M`` positions carry a
    distribution; the others keep :func:`draw`'s choice (a replayed graph passes every
    draft slot of its static shape and flags the ones that carry ``q``).

    ``kernels`` (``KernelPolicy.sampler``): where :func:`draw` runs as its Triton
    kernel (see there); the tokens are the same either way."""
    cols = _columns(plan, packed)
    logp = process_step(logits, plan, packed)
    seed_lo, seed_hi = cols[:, _C["seed_lo"]].long(), cols[:, _C["seed_hi"]].long()
    index = cols[:, _C["index"]].long()
    choices = draw(
        logp, cols[:, _C["temperature"]] == 0, seed_lo, seed_hi, index,
        any_sampled=plan.any_sampled, kernels=kernels,
    )
    if drafted is not None:
        pos, logq, drafts, use = drafted
        spec = speculative_choices(logp[pos], logq, drafts, seed_lo[pos], seed_hi[pos], index[pos],
                                   kernels)
        if use is not None:
            spec = torch.where(use, spec, choices[pos])
        choices = choices.index_put((pos,), spec)
    if not plan.logprob_positions:
        return choices
    start = plan.logprob_start
    lp_index = packed[start : start + len(plan.logprob_positions)].long()
    raw = torch.log_softmax(logits[lp_index].float(), dim=-1)
    # With drafts coupled to the draw, the token emitted at a position (when the row
    # gets that far) is the choice there, accepted draft or not.
    token_lp = raw.gather(1, choices[lp_index][:, None])
    rank = (raw > token_lp).sum(dim=-1, keepdim=True) + 1
    parts = []
    if plan.max_logprobs:
        top = torch.topk(raw, plan.max_logprobs, dim=-1)
        parts += [top.values.contiguous().view(torch.int32).long(), top.indices]
    parts += [token_lp.contiguous().view(torch.int32).long(), rank]
    return torch.cat([choices, torch.cat(parts, dim=1).reshape(-1)])


def read_step(values: Sequence[int], plan: DrawPlan) -> tuple[list[int], dict[int, dict[int, Logprob]]]:
    """Decode :func:`sample_step`'s output, read back as a list: the choice per
    position, and per logprob position its ``{token: Logprob}`` (the ``k`` most likely
    tokens and the chosen one, as :func:`token_logprobs` gives them)."""
    n = plan.num_positions
    choices = [int(v) for v in values[:n]]
    logprobs: dict[int, dict[int, Logprob]] = {}
    if not plan.logprob_positions:
        return choices, logprobs
    width, m = plan.payload_width, plan.max_logprobs
    payload = np.asarray(values[n:], dtype=np.int64).reshape(-1, width)
    bits = payload.astype(np.int32)  # the low 32 bits: float32 patterns where they are floats
    for row, (pos, k) in enumerate(zip(plan.logprob_positions, plan.logprob_k)):
        top_values = bits[row, :m].view(np.float32).tolist()
        top_ids = payload[row, m : 2 * m].tolist()
        out: dict[int, Logprob] = {}
        for rank, (v, i) in enumerate(zip(top_values[:k], top_ids[:k]), start=1):
            out[i] = Logprob(logprob=v, rank=rank)
        token = choices[pos]
        if token not in out:
            v = bits[row, 2 * m : 2 * m + 1].view(np.float32).tolist()[0]
            out[token] = Logprob(logprob=v, rank=int(payload[row, 2 * m + 1]))
        logprobs[pos] = out
    return choices, logprobs


# --- speculative sampling with a drafter's distribution -----------------------------
#
# A drafter with a distribution of its own (a draft model, an MTP head) samples draft x
# at a position from q; the target accepts it with probability min(1, p(x) / q(x)) and
# otherwise emits a sample of the residual max(0, p - q), normalised: every emitted
# token is then distributed as p. Both draws are counter based like :func:`draw`, from
# the same (seed, index, token) hash with salted seed words, so the drafter's sample,
# the acceptance test and the residual sample are independent streams and a seeded
# request stays reproducible. The accepted-or-residual token becomes the position's
# choice: rejection means p(x) < q(x), where the residual is 0, so the choice equals the
# draft exactly when it is accepted and the walk of :func:`verify_choices` applies.
#
# Every op below works row by row (the uniforms hash a position's own seed, index and
# token; the reductions are per row), so a position's choice does not depend on which
# other positions are computed beside it: an eager step computes its distribution
# drafts' positions only, a replayed decode graph every draft slot of its static shape
# (:mod:`hybridserve.runner.cuda_graph`), and both give the same tokens.

LOGQ_DTYPE = torch.float32
"""The dtype of a drafter's ``log q`` everywhere: what the drafters return
(:func:`hybridserve.drafters.base.draft_choices`), keep per request and hand to the
eager sampler, and what a decode graph's static ``log q`` buffer holds, so both paths
test acceptance on the same values. float32, not float64: the target's ``log p`` is
float32 already (:func:`process_step`), so float64 ``q`` would not make the test any
more exact, while the graph's buffer (``max_batch x k`` rows of the vocabulary:
0.44 GiB at 256 rows x 3 drafts x a 152k vocabulary) and every kept ``log q`` would double. The
drafter samples its draft from the rounded ``q`` itself (:func:`draft_draw` of the
float32 values), so the ``q`` the test divides by is the one the draft came from; the
test itself runs in float64 (``u`` has 31 bits)."""

_DRAFT_SALT = 0x2545F491
_ACCEPT_SALT = 0x5851F42D


def draft_draw(
    logq: torch.Tensor,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    index: torch.Tensor,
    kernels: str = "auto",
) -> torch.Tensor:
    """The drafter's sample from ``logq [N, vocab]`` (log-probabilities, any float
    dtype; drawn in float64) -> ``[N]``. ``kernels`` as for :func:`draw`: the kernel
    draws every row sampled, with the drafter's salted seed words."""
    if _sampler_kernel(kernels, logq):
        return sampling_kernels.draw(logq, None, seed_lo ^ _DRAFT_SALT, seed_hi, index)
    u = uniforms(seed_lo ^ _DRAFT_SALT, seed_hi, index, logq.shape[-1])
    return torch.argmax(logq.double() - torch.log(-torch.log(u)), dim=-1)


def speculative_choices(
    logp: torch.Tensor,
    logq: torch.Tensor,
    drafts: torch.Tensor,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    index: torch.Tensor,
    kernels: str = "auto",
) -> torch.Tensor:
    """Per draft position: the draft ``drafts[i]`` if accepted (``u < p(x) / q(x)``), else
    a sample of the normalised residual ``max(0, p - q)``. ``logp`` / ``logq``: the
    target's processed and the drafter's log-probabilities ``[N, vocab]`` (any float
    dtype: the test and the residual are computed in float64). ``kernels`` as for
    :func:`draw`: the residual's draw then runs as one pass over both rows
    (:func:`hybridserve.kernels.sampling.residual_draw`, the same tokens) and the
    acceptance test reads the drafts' two values only, so no ``[N, vocab]`` table is
    made; the torch code below is the twin."""
    if _sampler_kernel(kernels, logp, logq):
        x = drafts.long()[:, None]
        u = uniforms_at(seed_lo ^ _ACCEPT_SALT, seed_hi, index, x)[:, 0]
        # exp of the gathered values: the twin's gather of the exp'd tables, elementwise.
        accept = u * logq.gather(1, x)[:, 0].double().exp() < logp.gather(1, x)[:, 0].double().exp()
        choice = sampling_kernels.residual_draw(logp, logq, seed_lo, seed_hi, index)
        return torch.where(accept, drafts.long(), choice)
    vocab = logp.shape[-1]
    p, q = logp.double().exp(), logq.double().exp()
    x = drafts.long()[:, None]
    u = uniforms_at(seed_lo ^ _ACCEPT_SALT, seed_hi, index, x)[:, 0]
    accept = u * q.gather(1, x)[:, 0] < p.gather(1, x)[:, 0]
    # p - q in q's memory (the same bits: negation is exact), clamped at 0; in place
    # because a replayed graph runs this on every draft slot of its largest shape.
    residual = q.neg_().add_(p).clamp_min_(0.0)
    # All-zero residual only when p == q, where acceptance is certain: any fallback works.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    gumbel = torch.log(-torch.log(uniforms(seed_lo, seed_hi, index, vocab)))
    keys = residual.log_().sub_(gumbel)
    return torch.where(accept, drafts.long(), torch.argmax(keys, dim=-1))
