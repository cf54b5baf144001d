"""Tests of the cross-program race checker, including the seed's bug pattern."""

import os

# The interpreter must be chosen before any kernel below is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as interp

if os.environ["TRITON_INTERPRET"] != "1":
    # Every test here runs kernels through the race checker, which needs the CPU
    # interpreter: a GPU run (TRITON_INTERPRET=0) skips the module.
    pytest.skip("needs TRITON_INTERPRET=1 (the race checker)", allow_module_level=True)

from hybridserve.testing import racecheck  # noqa: E402

# --------------------------------------------------------------------------------------
# The seed's bug pattern, and its fixed form
# --------------------------------------------------------------------------------------
# grid (requests, layers * state types). Every program decides from num_accepted[req]
# whether its layer's checkpoint must be copied out of the running-state pages. In the
# buggy form program state_idx == 0 resets num_accepted[req] to 1 in place after its
# copy; programs that run later see 1 and skip their layer.


@triton.jit
def _copy_checkpoint(states, src_pages, dst_page, req, state_idx, accepted, computed,
                     interval, max_q, num_pages, E: tl.constexpr):
    running = computed - accepted + 1
    aligned = computed // interval * interval
    crossed = aligned >= running
    if crossed:
        bias = aligned - running
        src = tl.load(src_pages + req * max_q + bias)
        dst = tl.load(dst_page + req)
        offs = tl.arange(0, E)
        base = states + state_idx * num_pages * E
        tl.store(base + dst * E + offs, tl.load(base + src * E + offs))
    return crossed


@triton.jit
def _seed_buggy_kernel(num_accepted, new_computed, states, src_pages,
                       dst_page, interval, max_q, num_pages, E: tl.constexpr):
    req = tl.program_id(0)
    state_idx = tl.program_id(1)
    accepted = tl.load(num_accepted + req)
    computed = tl.load(new_computed + req)
    crossed = _copy_checkpoint(states, src_pages, dst_page, req, state_idx,
                               accepted, computed, interval, max_q, num_pages, E)
    if crossed & (state_idx == 0):
        tl.store(num_accepted + req, 1)


@triton.jit
def _seed_fixed_kernel(num_accepted, num_accepted_out, new_computed, states,
                       src_pages, dst_page, interval, max_q, num_pages, E: tl.constexpr):
    req = tl.program_id(0)
    state_idx = tl.program_id(1)
    accepted = tl.load(num_accepted + req)
    computed = tl.load(new_computed + req)
    crossed = _copy_checkpoint(states, src_pages, dst_page, req, state_idx,
                               accepted, computed, interval, max_q, num_pages, E)
    if state_idx == 0:
        tl.store(num_accepted_out + req, tl.where(crossed, 1, accepted))


def _seed_inputs(num_reqs: int, num_states: int, interval: int = 4, max_q: int = 4, e: int = 8):
    """Random requests; about half cross a grid point with the running state past it."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    cross = torch.rand(num_reqs, generator=g) < 0.5
    cross[0], cross[-1] = True, False
    base = torch.randint(1, 40, (num_reqs,), generator=g, dtype=torch.int32) * interval
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32)
    new_computed = torch.zeros(num_reqs, dtype=torch.int32)
    for r in range(num_reqs):
        if cross[r]:
            # Grid point `base` is crossed at S_j with j < a - 1.
            a = int(torch.randint(2, max_q + 1, (), generator=g))
            j = int(torch.randint(0, a - 1, (), generator=g))
            n = int(base[r]) - 1 - j
        else:
            a = int(torch.randint(1, min(max_q, interval - 1) + 1, (), generator=g))
            n = int(base[r])
        num_accepted[r], new_computed[r] = a, n + a
    num_pages = num_reqs * (max_q + 1)
    pages = torch.randperm(num_pages, generator=g).to(torch.int32)
    src_pages = pages[: num_reqs * max_q].reshape(num_reqs, max_q).contiguous()
    dst_page = pages[num_reqs * max_q:].contiguous()
    states = torch.randn(num_states, num_pages, e, generator=g)
    running = new_computed - num_accepted + 1
    assert torch.equal((new_computed // interval * interval) >= running, cross)
    return dict(
        num_accepted=num_accepted, new_computed=new_computed, states=states,
        src_pages=src_pages, dst_page=dst_page, interval=interval, max_q=max_q,
        num_pages=num_pages, E=e,
    ), cross


def test_seed_bug_pattern_is_flagged_with_argument_element_and_programs():
    num_reqs, num_states = 6, 4
    args, cross = _seed_inputs(num_reqs, num_states)
    report = racecheck.check(_seed_buggy_kernel, (num_reqs, num_states), **args)
    assert not report.clean
    assert report.arguments() == {"num_accepted"}
    crossing = set(torch.nonzero(cross).flatten().tolist())
    assert {c.element for c in report.conflicts} == crossing
    assert report.num_conflicting_elements == len(crossing)
    for c in report.conflicts:
        assert c.kind == "write-read"
        assert c.index == (c.element,)
        # The writer is state_idx 0 of that request; every other state of it reads.
        assert c.first == (c.element, 0, 0)
        assert c.second[0] == c.element and c.second[1] != 0
    pairs = {(c.first, c.second) for c in report.conflicts}
    assert len(pairs) == len(crossing) * (num_states - 1)
    text = str(report)
    assert "num_accepted" in text and "write-read" in text


def test_seed_fixed_form_is_clean():
    num_reqs, num_states = 6, 4
    args, cross = _seed_inputs(num_reqs, num_states)
    out = torch.full((num_reqs,), -7, dtype=torch.int32)
    reference_out = torch.where(cross, 1, args["num_accepted"])
    report = racecheck.check(_seed_fixed_kernel, (num_reqs, num_states),
                             num_accepted_out=out, **args)
    assert report.clean, str(report)
    assert report.bytes_stored > 0 and report.bytes_loaded > 0
    assert torch.equal(out, reference_out)
    assert racecheck.assert_race_free(
        _seed_fixed_kernel, (num_reqs, num_states), num_accepted_out=out, **args
    ).clean


def test_order_runner_shows_seed_bug_and_not_the_fix():
    num_reqs, num_states = 5, 6
    args, cross = _seed_inputs(num_reqs, num_states)
    buggy = racecheck.run_in_orders(_seed_buggy_kernel, (num_reqs, num_states), lambda: args,
                                    seed=int(torch.randint(0, 1000, ())))
    assert not buggy.consistent
    assert "states" in {d.argument for d in buggy.differences if d.order == "reversed"}
    # Forward order: state 0 runs first and resets, so only state 0 of each crossing
    # request got its checkpoint; reversed order copies every state.
    fwd = buggy.outputs["forward"]["states"]
    rev = buggy.outputs["reversed"]["states"]
    for req in torch.nonzero(cross).flatten().tolist():
        dst = int(args["dst_page"][req])
        assert torch.equal(fwd[0, dst], rev[0, dst])
        for s in range(1, num_states):
            assert torch.equal(fwd[s, dst], args["states"][s, dst])
            assert not torch.equal(rev[s, dst], args["states"][s, dst])
    assert "states" in str(buggy)

    def fixed_args():
        return {**args, "num_accepted_out": torch.zeros(num_reqs, dtype=torch.int32)}

    fixed = racecheck.run_in_orders(_seed_fixed_kernel, (num_reqs, num_states), fixed_args)
    assert fixed.consistent, str(fixed)
    assert fixed.orders == ("forward", "reversed", "shuffled")
    # Every crossing request has its checkpoint in every state.
    states = fixed.outputs["shuffled"]["states"]
    for req in torch.nonzero(cross).flatten().tolist():
        n = int(args["new_computed"][req] - args["num_accepted"][req])
        bias = (n + int(args["num_accepted"][req])) // 4 * 4 - n - 1
        src = int(args["src_pages"][req, bias])
        dst = int(args["dst_page"][req])
        assert torch.equal(states[:, dst], args["states"][:, src])


# --------------------------------------------------------------------------------------
# Masks, atomics, grids, arguments
# --------------------------------------------------------------------------------------


@triton.jit
def _overlapping_blocks_kernel(buf_ptr, STEP: tl.constexpr, BLOCK: tl.constexpr,
                               USE_MASK: tl.constexpr, INT_MASK: tl.constexpr):
    # Program p's block [p * STEP, p * STEP + BLOCK) overlaps program p + 1's; the mask
    # keeps only the first STEP lanes, which do not overlap. Triton accepts an integer
    # mask on loads only (the interpreter rejects it unless the checker coerces it).
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    offs = pid * STEP + lanes
    if USE_MASK:
        if INT_MASK:
            vals = tl.load(buf_ptr + offs, mask=(lanes < STEP).to(tl.int32), other=0.0)
        else:
            vals = tl.load(buf_ptr + offs, mask=lanes < STEP, other=0.0)
        tl.store(buf_ptr + offs, vals + pid * 1000 + lanes, mask=lanes < STEP)
    else:
        vals = tl.load(buf_ptr + offs)
        tl.store(buf_ptr + offs, vals + pid * 1000 + lanes)


@pytest.mark.parametrize("int_mask", [False, True])
def test_masked_off_lanes_are_not_counted(int_mask):
    n_prog, step, block = 5, 4, 8
    buf = torch.randn(n_prog * step + block, dtype=torch.float64)
    before = buf.clone()
    report = racecheck.check(_overlapping_blocks_kernel, (n_prog,), buf, STEP=step, BLOCK=block,
                             USE_MASK=True, INT_MASK=int_mask)
    assert report.clean, str(report)
    assert report.bytes_stored == report.bytes_loaded == n_prog * step * 8
    added = torch.tensor([p * 1000 + i for p in range(n_prog) for i in range(step)],
                         dtype=torch.float64)
    assert torch.equal(buf[: n_prog * step], before[: n_prog * step] + added)
    assert torch.equal(buf[n_prog * step:], before[n_prog * step:])


def test_unmasked_overlap_is_a_write_write_conflict():
    n_prog, step, block = 5, 4, 8
    buf = torch.randn(n_prog * step + block)
    report = racecheck.check(_overlapping_blocks_kernel, (n_prog,), buf, STEP=step, BLOCK=block,
                             USE_MASK=False, INT_MASK=False)
    assert report.arguments() == {"buf_ptr"}
    # Elements [4(p+1), 4(p+1) + 4) are written by p and p + 1, for p = 0 .. 3.
    assert {c.element for c in report.conflicts} == set(range(step, n_prog * step))
    assert all(c.kind == "write-write" for c in report.conflicts)
    assert all(c.second[0] == c.first[0] + 1 == c.element // step for c in report.conflicts)


@triton.jit
def _ticket_kernel(counter_ptr, tickets_ptr, PEEK: tl.constexpr):
    pid = tl.program_id(0)
    ticket = tl.atomic_add(counter_ptr, 1)
    tl.store(tickets_ptr + pid, ticket)
    if PEEK:  # noqa: SIM102 (a compile-time branch, kept apart from the runtime one)
        if pid == 0:
            tl.store(tickets_ptr + pid, tl.load(counter_ptr))


def test_atomic_counter_shared_by_all_programs_is_clean():
    n = 7
    counter = torch.zeros(1, dtype=torch.int32)
    tickets = torch.full((n,), -1, dtype=torch.int32)
    report = racecheck.check(_ticket_kernel, (n,), counter, tickets, PEEK=False)
    assert report.clean, str(report)
    assert report.bytes_atomic == 4
    assert int(counter) == n
    assert sorted(tickets.tolist()) == list(range(n))


def test_plain_load_of_an_atomic_counter_is_flagged():
    n = 4
    counter = torch.zeros(1, dtype=torch.int32)
    tickets = torch.zeros(n, dtype=torch.int32)
    report = racecheck.check(_ticket_kernel, (n,), counter, tickets, PEEK=True)
    assert report.arguments() == {"counter_ptr"}
    got = {(c.kind, c.first, c.second) for c in report.conflicts}
    assert got == {("atomic-read", (p, 0, 0), (0, 0, 0)) for p in range(1, n)}


def test_run_in_orders_really_reorders_programs():
    n = 9
    report = racecheck.run_in_orders(
        _ticket_kernel, (n,),
        lambda: (torch.zeros(1, dtype=torch.int32), torch.full((n,), -1, dtype=torch.int32)),
        seed=int(torch.randint(0, 1000, ())), PEEK=False,
    )
    fwd = report.outputs["forward"]["tickets_ptr"].tolist()
    rev = report.outputs["reversed"]["tickets_ptr"].tolist()
    shuf = report.outputs["shuffled"]["tickets_ptr"].tolist()
    assert fwd == list(range(n))
    assert rev == list(range(n))[::-1]
    assert sorted(shuf) == list(range(n))
    assert report.differing_arguments() == {"tickets_ptr"}
    assert all(d.num_differing > 0 for d in report.differences)


@triton.jit
def _grid3d_kernel(x_ptr, out_ptr, scale, NY: tl.constexpr, NZ: tl.constexpr,
                   COLLIDE_Z: tl.constexpr):
    x = tl.program_id(0)
    y = tl.program_id(1)
    z = tl.program_id(2)
    idx = (x * NY + y) * NZ + z
    if COLLIDE_Z:
        idx = (x * NY + y) * NZ
    tl.store(out_ptr + idx, tl.load(x_ptr + idx) * scale)


def test_three_dimensional_grid_with_kwargs_and_constexprs():
    nx, ny, nz = 3, 2, 4
    x = torch.randn(nx, ny, nz, dtype=torch.float64)
    out = torch.full_like(x, float("nan"))
    report = racecheck.check(_grid3d_kernel, (nx, ny, nz), x, out_ptr=out, scale=2.5,
                             NY=ny, NZ=nz, COLLIDE_Z=False)
    assert report.clean, str(report)
    assert report.grid == (nx, ny, nz)
    assert torch.equal(out, x * 2.5)

    report = racecheck.check(_grid3d_kernel, (nx, ny, nz), x, out_ptr=out, scale=2.5,
                             NY=ny, NZ=nz, COLLIDE_Z=True)
    assert report.arguments() == {"out_ptr"}
    assert {c.index for c in report.conflicts} == {(i, j, 0) for i in range(nx) for j in range(ny)}
    for c in report.conflicts:
        assert c.kind == "write-write"
        assert c.first[:2] == c.second[:2] == c.index[:2]
        assert c.first[2] < c.second[2]
    assert len(report.conflicts) == nx * ny * nz * (nz - 1) // 2


def test_two_dimensional_callable_grid():
    rows, cols, block = 4, 20, 8
    x = torch.randn(rows, cols)
    out = torch.empty_like(x)

    @triton.jit
    def scale_rows(x_ptr, out_ptr, cols, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < cols
        tl.store(out_ptr + r * cols + offs, tl.load(x_ptr + r * cols + offs, mask=m) * 3, mask=m)

    grid = lambda meta: (rows, triton.cdiv(cols, meta["BLOCK"]))
    report = racecheck.check(scale_rows, grid, x, out, cols, BLOCK=block)
    assert report.clean, str(report)
    assert report.grid == (rows, 3, 1)
    assert torch.equal(out, x * 3)


@triton.jit
def _pointer_table_kernel(table_ptr, n, BLOCK: tl.constexpr):
    # Reaches its data only through a raw address, as paged-state kernels do.
    pid = tl.program_id(0)
    base = tl.load(table_ptr).to(tl.pointer_type(tl.float32))
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(base + offs, tl.load(base + offs, mask=m) + pid, mask=m)


def test_named_memory_reached_through_a_pointer_table():
    data = torch.randn(6)
    table = torch.tensor([data.data_ptr()], dtype=torch.int64)
    report = racecheck.check(_pointer_table_kernel, (2,), table, 6, BLOCK=8,
                             named_memory={"pool": data})
    assert report.arguments() == {"pool"}
    assert {c.element for c in report.conflicts} == set(range(6))
    unnamed = racecheck.check(_pointer_table_kernel, (2,), table, 6, BLOCK=8)
    assert unnamed.arguments() == {"<unmapped>"}
    assert unnamed.num_conflicting_elements == 6 * 4  # reported per byte


def test_interpreter_is_restored_after_success_and_failure():
    builder = interp.interpreter_builder
    call, init_args = interp.GridExecutor.__call__, interp.GridExecutor._init_args_hst
    hooked = ("set_grid_dim", "set_grid_idx", "create_masked_load", "create_masked_store",
              "create_atomic_rmw", "create_atomic_cas", "create_atomic_load", "create_atomic_store")

    def assert_restored():
        assert not set(hooked) & set(vars(builder))
        assert interp.GridExecutor.__call__ is call
        assert interp.GridExecutor._init_args_hst is init_args

    out = torch.zeros(32)
    racecheck.check(_overlapping_blocks_kernel, (3,), out, STEP=4, BLOCK=8, USE_MASK=True,
                    INT_MASK=True)
    assert_restored()
    # Outside the checker the interpreter's own rule (no int masks) applies again.
    with pytest.raises(Exception, match="mask"):
        _overlapping_blocks_kernel[(3,)](out, STEP=4, BLOCK=8, USE_MASK=True, INT_MASK=True)
    with pytest.raises(KeyError), racecheck.record_launches():
        _grid3d_kernel[(1, 1, 1)](torch.zeros(1), torch.zeros(1), 1.0, NY=1, NZ=1,
                                  COLLIDE_Z=False)
        raise KeyError("fails inside the recording")
    assert_restored()
    # Plain launches after a recording run in forward order, unrecorded.
    counter, tickets = torch.zeros(1, dtype=torch.int32), torch.zeros(5, dtype=torch.int32)
    _ticket_kernel[(5,)](counter, tickets, PEEK=False)
    assert tickets.tolist() == list(range(5))


def test_record_launches_reports_each_launch():
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    out = torch.empty_like(x)
    with racecheck.record_launches() as rec:
        _grid3d_kernel[(4, 2, 3)](x, out, 1.0, NY=2, NZ=3, COLLIDE_Z=False)
        _grid3d_kernel[(4, 2, 3)](x, out, 1.0, NY=2, NZ=3, COLLIDE_Z=True)
    assert rec.launches == 2
    assert [r.clean for r in rec.reports] == [True, False]


def test_rejects_kernels_that_are_not_interpreted():
    with pytest.raises(TypeError, match="TRITON_INTERPRET"):
        racecheck.check(lambda: None, (1,))
    with pytest.raises(ValueError, match="program order"):
        racecheck.run_in_orders(_ticket_kernel, (1,), lambda: (), orders=("sideways",))


def test_import_without_interpreter_raises_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "import hybridserve.testing.racecheck"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "TRITON_INTERPRET=1" in proc.stderr
