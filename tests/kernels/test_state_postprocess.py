"""State postprocess (ownership transfer) and state copy: kernel vs twin, the worked
example of docs/state-lifecycle.md, the seed's scenario as a regression test, and the
race checker."""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from hybridserve.kernels.state_postprocess import (
    PostprocessResult,
    max_checkpoints_per_row,
    state_copy,
    state_copy_reference,
    state_postprocess,
    state_postprocess_reference,
)

if os.environ["TRITON_INTERPRET"] != "1":
    # Every test here runs kernels through the race checker, which needs the CPU
    # interpreter: a GPU run (TRITON_INTERPRET=0) skips the module.
    pytest.skip("needs TRITON_INTERPRET=1 (the race checker)", allow_module_level=True)

from hybridserve.testing import racecheck  # noqa: E402

POISON = -123456
FIELDS = [f.name for f in dataclasses.fields(PostprocessResult)]


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _random_step(g: torch.Generator, num_rows: int, interval: int, max_d: int = 5,
                 slot_spread: int = 7) -> dict:
    """A random step: non-contiguous slots, d_r in [0, max_d], n near grid points."""
    num_slots = num_rows * slot_spread + 3
    slots = torch.randperm(num_slots, generator=g)[:num_rows].to(torch.int32)
    num_computed = torch.randint(0, 5000, (num_slots,), generator=g, dtype=torch.int32)
    q = torch.randint(1, max_d + 2, (num_rows,), generator=g)
    max_q = int(q.max())
    for r in range(num_rows):
        grid_point = int(torch.randint(0, 50, (), generator=g)) * interval
        offset = int(torch.randint(-max_q - 1, 3, (), generator=g))
        num_computed[slots[r]] = max(0, grid_point + offset)
    num_accepted = torch.tensor(
        [int(torch.randint(1, int(qr) + 1, (), generator=g)) for qr in q], dtype=torch.int32
    )
    pages = torch.randperm(10 * num_slots + num_rows * max_q, generator=g).to(torch.int32)
    out_pages = torch.full((num_rows, max_q), -1, dtype=torch.int32)
    for r in range(num_rows):
        out_pages[r, : q[r]] = pages[r * max_q: r * max_q + q[r]]
    state_page = pages[num_rows * max_q: num_rows * max_q + num_slots].clone()
    state_page[torch.rand(num_slots, generator=g) < 0.2] = -1  # fresh sequences
    release_prev = torch.rand(num_rows, generator=g) < 0.6
    return dict(idx_mapping=slots, num_computed=num_computed, num_accepted=num_accepted,
                out_pages=out_pages, state_page=state_page, release_prev=release_prev,
                boundary_interval=interval)


def _poisoned_out(step: dict) -> PostprocessResult:
    b, q = step["out_pages"].shape
    k = max_checkpoints_per_row(q, step["boundary_interval"])
    s = step["num_computed"].shape[0]

    def full(*shape):
        return torch.full(shape, POISON, dtype=torch.int32)

    return PostprocessResult(full(s), full(s), full(b, k), full(b, k), full(b, q))


def _assert_same(got: PostprocessResult, want: PostprocessResult) -> None:
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype == torch.int32, name
        assert torch.equal(g, w), f"{name}:\n{g}\n!=\n{w}"


def _check_semantics(step: dict, res: PostprocessResult) -> None:
    """Independent restatement of the postprocess semantics (docs/state-lifecycle.md),
    for every row."""
    interval = step["boundary_interval"]
    for r, s in enumerate(step["idx_mapping"].tolist()):
        n = int(step["num_computed"][s])
        a = int(step["num_accepted"][r])
        pages = [p for p in step["out_pages"][r].tolist() if p >= 0]
        assert int(res.new_num_computed[s]) == n + a
        assert int(res.new_state_page[s]) == pages[a - 1]
        grid = [p for p in range(n + 1, n + a + 1) if p % interval == 0]
        k = len(grid)
        assert res.ckpt_len[r, :k].tolist() == grid
        assert res.ckpt_page[r, :k].tolist() == [pages[p - 1 - n] for p in grid]
        assert (res.ckpt_len[r, k:] == -1).all() and (res.ckpt_page[r, k:] == -1).all()
        released = [x for x in res.release_pages[r].tolist() if x >= 0]
        kept = {pages[a - 1], *(pages[p - 1 - n] for p in grid)}
        prev = int(step["state_page"][s])
        expect = set(pages) - kept
        if bool(step["release_prev"][r]) and prev >= 0:
            expect.add(prev)
        assert sorted(released) == sorted(expect)
        assert (res.release_pages[r, len(released):] == -1).all()
        # Every page of the step is either kept or released, exactly once.
        assert sorted(list(kept) + [x for x in released if x != prev]) == sorted(pages)


@pytest.mark.parametrize("interval", [1, 4, 16, 64])
def test_kernel_matches_twin_on_random_batches(interval):
    g = torch.Generator().manual_seed(_fresh_seed())
    for num_rows in (1, 5, 23):
        step = _random_step(g, num_rows, interval)
        want = state_postprocess_reference(**step)
        _check_semantics(step, want)
        got = state_postprocess(**step)
        _assert_same(got, want)

        out = _poisoned_out(step)
        with racecheck.record_launches() as rec:
            returned = state_postprocess(**step, out=out)
        assert returned is out
        assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
        # Batch slots get the twin's values; every other slot is left untouched.
        in_batch = torch.zeros(step["num_computed"].shape[0], dtype=torch.bool)
        in_batch[step["idx_mapping"].long()] = True
        for name in ("new_state_page", "new_num_computed"):
            assert torch.equal(getattr(out, name)[in_batch], getattr(want, name)[in_batch])
            assert (getattr(out, name)[~in_batch] == POISON).all()
        for name in ("ckpt_page", "ckpt_len", "release_pages"):
            assert torch.equal(getattr(out, name), getattr(want, name))


def test_design_worked_example():
    # boundary_interval 16, d = 3, n = 14: rows accept a = 1, 2, 4.
    step = dict(
        idx_mapping=torch.tensor([40, 3, 17], dtype=torch.int32),
        num_computed=torch.full((50,), 999, dtype=torch.int32).index_fill_(
            0, torch.tensor([40, 3, 17]), 14),
        num_accepted=torch.tensor([1, 2, 4], dtype=torch.int32),
        out_pages=torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]],
                               dtype=torch.int32),
        state_page=torch.arange(50, dtype=torch.int32) + 100,
        release_prev=torch.tensor([True, True, False]),
        boundary_interval=16,
    )
    for res in (state_postprocess_reference(**step), state_postprocess(**step)):
        # a = 1: count 15, state S_0, no checkpoint.
        assert int(res.new_num_computed[40]) == 15 and int(res.new_state_page[40]) == 10
        assert res.ckpt_page[0].tolist() == [-1] and res.ckpt_len[0].tolist() == [-1]
        assert res.release_pages[0].tolist() == [11, 12, 13, 140]
        # a = 2: count 16, state S_1 = checkpoint(16), one page in both roles.
        assert int(res.new_num_computed[3]) == 16 and int(res.new_state_page[3]) == 21
        assert res.ckpt_page[1].tolist() == [21] and res.ckpt_len[1].tolist() == [16]
        assert res.release_pages[1].tolist() == [20, 22, 23, 103]
        # a = 4: count 18, state S_3, checkpoint(16) = S_1; previous page not owned.
        assert int(res.new_num_computed[17]) == 18 and int(res.new_state_page[17]) == 33
        assert res.ckpt_page[2].tolist() == [31] and res.ckpt_len[2].tolist() == [16]
        assert res.release_pages[2].tolist() == [30, 32, -1, -1]
        assert int(res.new_num_computed[0]) == 999 and int(res.new_state_page[0]) == 100


def test_several_checkpoints_in_one_row():
    # interval 2, n = 3, q = 6, a = 5: grid points 4, 6, 8 -> S_0, S_2, S_4 (= state).
    step = dict(
        idx_mapping=torch.tensor([1], dtype=torch.int32),
        num_computed=torch.tensor([7, 3], dtype=torch.int32),
        num_accepted=torch.tensor([5], dtype=torch.int32),
        out_pages=torch.tensor([[50, 51, 52, 53, 54, 55]], dtype=torch.int32),
        state_page=torch.tensor([-1, 9], dtype=torch.int32),
        release_prev=torch.tensor([True]),
        boundary_interval=2,
    )
    for res in (state_postprocess_reference(**step), state_postprocess(**step)):
        assert res.ckpt_len.tolist() == [[4, 6, 8]]
        assert res.ckpt_page.tolist() == [[50, 52, 54]]
        assert int(res.new_state_page[1]) == 54 and int(res.new_num_computed[1]) == 8
        assert res.release_pages.tolist() == [[51, 53, 55, 9, -1, -1]]


def test_launcher_rejects_bad_inputs():
    g = torch.Generator().manual_seed(_fresh_seed())
    step = _random_step(g, 4, 4)
    with pytest.raises(ValueError, match="num_accepted"):
        state_postprocess(**{**step, "num_accepted": step["num_accepted"].long()})
    with pytest.raises(ValueError, match="release_prev"):
        state_postprocess(**{**step, "release_prev": step["release_prev"].int()})
    with pytest.raises(ValueError, match="boundary_interval"):
        state_postprocess(**{**step, "boundary_interval": 0})
    out = _poisoned_out(step)
    out.new_num_computed = step["num_computed"]  # writing the input in place: the seed bug
    with pytest.raises(ValueError, match="overlaps an input"):
        state_postprocess(**step, out=out)
    bad = {**step, "num_accepted": step["num_accepted"].clone()}
    bad["num_accepted"][0] = 0
    with pytest.raises(ValueError, match="num_accepted"):
        state_postprocess_reference(**bad)


# --------------------------------------------------------------------------------------
# The seed's scenario: 64 requests, 24 Mamba layers, non-contiguous slots
# --------------------------------------------------------------------------------------

NUM_LAYERS = 24
CONV_DIM, D_CONV, HEADS, HEAD_DIM, D_STATE = 8, 4, 2, 4, 4


def _seed_scenario(g: torch.Generator, num_rows: int = 64, interval: int = 16, d: int = 3):
    """Every request ran q = 1 + d tokens; kinds of rows (all present, shuffled):
    crossing with the running state past the grid point (the seed's racy case), crossing
    exactly at the running state, and not crossing."""
    q = d + 1
    slots = (torch.randperm(num_rows, generator=g) * 37 + 11).to(torch.int32)
    num_slots = int(slots.max()) + 5
    num_computed = torch.randint(0, 10**4, (num_slots,), generator=g, dtype=torch.int32)
    kinds = torch.arange(num_rows) % 3
    kinds = kinds[torch.randperm(num_rows, generator=g)]
    num_accepted = torch.zeros(num_rows, dtype=torch.int32)
    for r in range(num_rows):
        base = int(torch.randint(1, 100, (), generator=g)) * interval
        if kinds[r] == 0:  # crossed at S_j, state S_{a-1} beyond it, same block
            a = int(torch.randint(2, q + 1, (), generator=g))
            j = int(torch.randint(0, a - 1, (), generator=g))
        elif kinds[r] == 1:  # crossed at the accepted position itself
            a = int(torch.randint(1, q + 1, (), generator=g))
            j = a - 1
        else:  # no grid point in (n, n + a]
            a = int(torch.randint(1, q + 1, (), generator=g))
            j = -1
        n = base - 1 - j if j >= 0 else base + int(torch.randint(0, interval - q, (), generator=g))
        num_computed[slots[r]] = n
        num_accepted[r] = a
    num_pages = num_rows * (q + 2) + 8
    pages = torch.randperm(num_pages, generator=g).to(torch.int32)
    out_pages = pages[: num_rows * q].reshape(num_rows, q).contiguous()
    state_page = torch.full((num_slots,), -1, dtype=torch.int32)
    state_page[slots.long()] = pages[num_rows * q: num_rows * (q + 1)]
    spare = pages[num_rows * (q + 1):].contiguous()  # never used by the step
    step = dict(idx_mapping=slots, num_computed=num_computed, num_accepted=num_accepted,
                out_pages=out_pages, state_page=state_page,
                release_prev=torch.rand(num_rows, generator=g) < 0.7, boundary_interval=interval)
    conv = [torch.randn(num_pages, CONV_DIM, D_CONV - 1, generator=g) for _ in range(NUM_LAYERS)]
    ssm = [torch.randn(num_pages, HEADS, HEAD_DIM, D_STATE, generator=g)
           for _ in range(NUM_LAYERS)]
    return step, kinds, conv, ssm, spare


def _expected_states(step: dict, r: int) -> tuple[int, list[tuple[int, int]]]:
    """(page of S_{a-1}, [(grid point, page of its S_j)]), straight from
    docs/state-lifecycle.md."""
    s = int(step["idx_mapping"][r])
    n, a = int(step["num_computed"][s]), int(step["num_accepted"][r])
    pages = step["out_pages"][r].tolist()
    grid = [p for p in range(n + 1, n + a + 1) if p % step["boundary_interval"] == 0]
    return pages[a - 1], [(p, pages[p - 1 - n]) for p in grid]


def test_seed_scenario_regression():
    g = torch.Generator().manual_seed(_fresh_seed())
    step, kinds, conv, ssm, spare = _seed_scenario(g)
    num_rows = step["idx_mapping"].shape[0]
    twin = state_postprocess_reference(**step)
    crossed = (twin.ckpt_page[:, 0] >= 0).tolist()
    assert crossed == (kinds != 2).tolist()
    running_past = [int(twin.ckpt_page[r, 0]) != int(twin.new_state_page[step["idx_mapping"][r]])
                    for r in range(num_rows)]
    assert sum(c and p for c, p in zip(crossed, running_past)) >= num_rows // 4

    # Same result as the twin under every program order.
    orders = racecheck.run_launcher_in_orders(state_postprocess, lambda: step,
                                              seed=_fresh_seed())
    assert orders.consistent, str(orders)
    for order in orders.orders:
        got = PostprocessResult(**{f: orders.outputs[order][f"return.{f}"] for f in FIELDS})
        _assert_same(got, twin)
        # Applying the outcome (page-id updates): in each of the 24 layers, the request's
        # state and checkpoints are the exact tensors the forward wrote for S_{a-1}, S_j.
        for r in range(num_rows):
            s = int(step["idx_mapping"][r])
            state_src, ckpts = _expected_states(step, r)
            state = int(got.new_state_page[s])
            ck = [(int(got.ckpt_len[r, k]), int(got.ckpt_page[r, k])) for k in range(len(ckpts))]
            assert len(ckpts) == (1 if crossed[r] else 0)
            for layer in range(NUM_LAYERS):
                assert torch.equal(conv[layer][state], conv[layer][state_src])
                assert torch.equal(ssm[layer][state], ssm[layer][state_src])
                for (p, page), (p_src, page_src) in zip(ck, ckpts):
                    assert p == p_src
                    assert torch.equal(conv[layer][page], conv[layer][page_src])
                    assert torch.equal(ssm[layer][page], ssm[layer][page_src])

    # A copying policy: move every checkpoint to a spare page, in all 24 layers. Both
    # kernels must be clean under the race checker.
    src = twin.ckpt_page[:, 0].contiguous()
    dst = torch.where(src >= 0, spare[:num_rows], -1).to(torch.int32)
    ref_conv, ref_ssm = [t.clone() for t in conv], [t.clone() for t in ssm]
    state_copy_reference(src, dst, ref_conv, ref_ssm)
    memory = {f"conv[{i}]": t for i, t in enumerate(conv)}
    memory.update({f"ssm[{i}]": t for i, t in enumerate(ssm)})
    before = ([t.clone() for t in conv], [t.clone() for t in ssm])
    with racecheck.record_launches(named_memory=memory) as rec:
        state_postprocess(**step)
        state_copy(src, dst, conv, ssm)
    assert len(rec.reports) == 2
    for report in rec.reports:
        assert report.clean, str(report)
    copied_rows = int((src >= 0).sum())
    page_bytes = sum(t[0].numel() * t.element_size() for t in conv + ssm)
    assert rec.reports[1].bytes_stored == copied_rows * page_bytes
    for layer in range(NUM_LAYERS):
        assert torch.equal(conv[layer], ref_conv[layer])
        assert torch.equal(ssm[layer], ref_ssm[layer])
        for r in range(num_rows):
            _, ckpts = _expected_states(step, r)
            if ckpts:
                page_src = ckpts[0][1]
                assert torch.equal(conv[layer][int(dst[r])], before[0][layer][page_src])
                assert torch.equal(ssm[layer][int(dst[r])], before[1][layer][page_src])


# The guard: the same decision made per (request, layer, state type) while program 0
# of each request updates num_computed in place, as the seed's kernel did.


@triton.jit
def _inplace_postprocess_kernel(idx_mapping, num_computed, num_accepted, out_pages, ckpt_dst,
                                states, interval, max_q, num_pages, E: tl.constexpr):
    r = tl.program_id(0)
    state_idx = tl.program_id(1)
    slot = tl.load(idx_mapping + r)
    n = tl.load(num_computed + slot)
    a = tl.load(num_accepted + r)
    j = (n // interval + 1) * interval - 1 - n
    if j < a:
        src = tl.load(out_pages + r * max_q + j)
        dst = tl.load(ckpt_dst + r)
        offs = tl.arange(0, E)
        base = states + state_idx * num_pages * E
        tl.store(base + dst * E + offs, tl.load(base + src * E + offs))
    if state_idx == 0:
        tl.store(num_computed + slot, n + a)


def test_inplace_variant_is_flagged():
    g = torch.Generator().manual_seed(_fresh_seed())
    step, kinds, conv, ssm, spare = _seed_scenario(g)
    num_rows, max_q = step["out_pages"].shape
    # The per-layer states stacked as [layers * 2, pages, elements] for this variant.
    e = 16
    states = torch.stack([t.reshape(t.shape[0], -1)[:, :e] for pair in zip(conv, ssm)
                          for t in pair])
    args = dict(idx_mapping=step["idx_mapping"], num_computed=step["num_computed"],
                num_accepted=step["num_accepted"], out_pages=step["out_pages"],
                ckpt_dst=spare[:num_rows].contiguous(), states=states,
                interval=step["boundary_interval"], max_q=max_q, num_pages=states.shape[1], E=e)
    grid = (num_rows, 2 * NUM_LAYERS)
    report = racecheck.check(_inplace_postprocess_kernel, grid, max_conflicts=10_000,
                             **{k: v.clone() if isinstance(v, torch.Tensor) else v
                                for k, v in args.items()})
    assert not report.clean
    assert report.arguments() == {"num_computed"}
    batch = {int(s): r for r, s in enumerate(step["idx_mapping"])}
    assert {c.element for c in report.conflicts} == set(batch)
    for c in report.conflicts:
        r = batch[c.element]
        assert c.kind == "write-read" and c.first == (r, 0, 0) and c.second[0] == r
    assert "num_computed" in str(report)

    # The order runner sees it too (on 8 rows, to keep the interpreter quick): in
    # forward order only state 0 of each crossing request gets its checkpoint.
    sel = torch.cat([torch.nonzero(kinds != 2).flatten()[:5], torch.nonzero(kinds == 2).flatten()[:3]])
    rows = sel.numel()
    small = {**args, **{k: args[k][sel].contiguous()
                        for k in ("idx_mapping", "num_accepted", "out_pages", "ckpt_dst")}}
    orders = racecheck.run_in_orders(_inplace_postprocess_kernel, (rows, 2 * NUM_LAYERS),
                                     lambda: small, orders=("forward", "reversed"))
    assert not orders.consistent
    assert "states" in orders.differing_arguments()
    fwd = orders.outputs["forward"]["states"]
    rev = orders.outputs["reversed"]["states"]
    for i in range(rows):
        dst = int(small["ckpt_dst"][i])
        if kinds[sel[i]] != 2:
            assert torch.equal(fwd[0, dst], rev[0, dst])
            assert not torch.equal(fwd[0, dst], states[0, dst])
            for k in range(1, 2 * NUM_LAYERS):
                assert torch.equal(fwd[k, dst], states[k, dst])
                assert not torch.equal(rev[k, dst], states[k, dst])
        else:
            # Reversed, program 0 (the writer) runs last, so nobody sees its update.
            assert torch.equal(rev[:, dst], states[:, dst])


# --------------------------------------------------------------------------------------
# State copy
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("conv_dtype", [torch.bfloat16, torch.float32])
def test_state_copy_matches_twin(conv_dtype):
    g = torch.Generator().manual_seed(_fresh_seed())
    num_layers, num_pages, rows = 3, 30, 7
    conv = [torch.randn(num_pages, 6, 3, generator=g).to(conv_dtype) for _ in range(num_layers)]
    ssm = [torch.randn(num_pages, 2, 3, 5, generator=g, dtype=torch.float64)
           for _ in range(num_layers)]
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    src, dst = perm[:rows].clone(), perm[rows: 2 * rows].clone()
    src[1] = -1
    dst[4] = -1
    ref_conv, ref_ssm = [t.clone() for t in conv], [t.clone() for t in ssm]
    state_copy_reference(src, dst, ref_conv, ref_ssm)
    memory = {f"conv[{i}]": t for i, t in enumerate(conv)}
    memory.update({f"ssm[{i}]": t for i, t in enumerate(ssm)})
    # Tiny blocks and chunks so pages span several programs and loop iterations.
    with racecheck.record_launches(named_memory=memory) as rec:
        state_copy(src, dst, conv, ssm, block_bytes=16, chunk_bytes=32)
    assert rec.reports[0].clean, str(rec.reports[0])
    assert rec.reports[0].grid[2] > 1
    for got, want in zip(conv + ssm, ref_conv + ref_ssm):
        assert torch.equal(got, want)

    orders = racecheck.run_launcher_in_orders(
        state_copy,
        lambda: dict(src_pages=src, dst_pages=dst, conv=conv, ssm=ssm, block_bytes=16,
                     chunk_bytes=32),
        seed=_fresh_seed(),
    )
    assert orders.consistent, str(orders)
    for name, t in orders.outputs["shuffled"].items():
        if name.startswith("conv["):
            assert torch.equal(t, ref_conv[int(name[5:-1])])


def test_state_copy_with_colliding_destinations_is_flagged():
    g = torch.Generator().manual_seed(_fresh_seed())
    conv = [torch.randn(8, 4, 3, generator=g) for _ in range(2)]
    ssm = [torch.randn(8, 2, 2, 2, generator=g) for _ in range(2)]
    src = torch.tensor([0, 1], dtype=torch.int32)
    dst = torch.tensor([5, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="destination"):
        state_copy_reference(src, dst, [t.clone() for t in conv], [t.clone() for t in ssm])
    memory = {f"ssm[{i}]": t for i, t in enumerate(ssm)}
    memory.update({f"conv[{i}]": t for i, t in enumerate(conv)})
    with racecheck.record_launches(named_memory=memory) as rec:
        state_copy(src, dst, conv, ssm)
    report = rec.reports[0]
    assert report.arguments() == set(memory)
    assert all(c.kind == "write-write" and c.first[0] == 0 and c.second[0] == 1
               for c in report.conflicts)
    assert {c.index[0] for c in report.conflicts} == {5}
