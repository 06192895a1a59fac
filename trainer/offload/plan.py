"""Pure schedules: which block sits where in the GPU ring, and when each copy may start.

How. The GPU keeps one ring buffer of `capacity` bytes for the streamed blocks. At the start of a step the
first blocks of the execution order fill it from offset 0. Every block that is needed but not resident is
placed at a moving pointer: *upwards* while the pass runs forward, *downwards* while it runs backward, wrapping
at either end (the seed's allocation diagram: "tensors can be allocated in both directions depending on the
execution direction"). A placement claims the resident blocks it overlaps; the copy may start once every
claimed block has passed its last use before the new block is needed (its *release point*). Loads are issued
in the order the blocks are needed, each as early as its region is free, which loads as far ahead as the ring
allows. Blocks whose region nobody claims simply stay: in training that is the tail kept across the turn.

Why pure. Everything here is decided from block sizes alone, so it is tested on the CPU against the seed's
three diagrams (9 blocks at 33% sampling and training, 12 blocks at 50% allocation), and the conductor only
replays it: on the GPU nothing is decided in the hot path, and every wait is an event the plan names.

Periodicity. Training returns to its start state after every step (forward fills upwards, backward refills
downwards to the same places). Cyclic sampling need not: 9 blocks in 6 slots shift by 3 slots a step. The
plan simulates steps until the state at a step boundary repeats and stores the steps from there as a loop.

Beyond the seed: its cyclic sampling schedule moves every block every step whatever the fraction. `plan_for`
(what the conductor runs) keeps part of the model fixed in the ring when that moves fewer bytes, and cycles
only the rest through a two-block window: about f W bytes a step. Which part stays decides whether those
copies hide behind compute: the streamed blocks are spread evenly by position (`spread_fixed`), so the
copies arrive at an even rate per block computed (Flux-12B at f=0.5 on an H200: the cycle moved 23.7 GB,
1.44x the resident forward; spreading by bytes 13.7 GB, 1.10x; by position the same bytes, 1.02-1.03x,
bench/history/2026-11-22.md run 5).

Left out: choosing which blocks stay resident by measured cost (training always keeps the next blocks in
execution order; sampling assumes every block computes for about as long), and any timing model
(trainer/planner/ predicts times).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FWD, BWD = "F", "B"
MODES = ("train", "sample")


#: activation offloading (offload/activations.py) leaves the checkpoint inputs of this many blocks on the GPU: the
#: last checkpointed ones in forward order, whose backward comes first. Backward holds two blocks' inputs on the
#: GPU anyway (the one being differentiated, fetched, and the next, prefetched), so at block n-1 and n-2 these are
#: exactly those two; forward holds them beside a block's forward, far smaller than backward's working set. Saved:
#: their round trip through pinned RAM (Wan 14B at 720p x 81: 2 x 0.77 GB of RAM and of copies each way a step).
INPUTS_ON_DEVICE = 2


def inputs_on_device(checkpointed: list[bool], n: int = INPUTS_ON_DEVICE) -> frozenset[int]:
    """The blocks whose checkpoint inputs activation offloading keeps on the device: the last `n` of those
    recomputed in backward (`checkpointed[i]`), in forward order."""
    recomputed = [i for i, c in enumerate(checkpointed) if c]
    return frozenset(recomputed[len(recomputed) - n:] if n > 0 else ())


def kept_blocks(checkpointed: list[bool]) -> frozenset[int]:
    """The blocks that keep their activations for backward (not recomputed: `checkpointed[i]` false), as
    train.gradient_checkpointing: auto leaves them."""
    return frozenset(i for i, c in enumerate(checkpointed) if not c)


class PlanError(ValueError):
    """The ring cannot hold what the schedule needs at once (raise `capacity`)."""


@dataclass(frozen=True)
class Load:
    """Copy `block` into the ring at byte `offset`, once position `after` has passed its release point.

    Positions count executions within one step (`Plan.sequence`); `after == -1` means before the step.
    `use` is the position the block is first needed at; `use >= len(sequence)` means the next step."""

    block: int
    offset: int
    after: int
    use: int
    claims: tuple[int, ...] = ()


@dataclass(frozen=True)
class Plan:
    mode: str
    sizes: tuple[int, ...]
    capacity: int
    sequence: tuple[tuple[str, int], ...]
    initial: dict[int, int]  # block -> ring offset resident before the first step
    steps: tuple[tuple[Load, ...], ...]  # loads issued during step i, in issue order
    loop: int  # steps[loop:] repeat for ever
    states: tuple[dict[int, int], ...] = field(default=(), repr=False)  # residency at each step start
    fixed: frozenset[int] = frozenset()  # blocks at the start of the ring for good (`make_plan`'s)
    held: frozenset[int] = frozenset()  # blocks on the device outside the ring: never loaded (`held_plan`)

    def step_loads(self, step: int) -> tuple[Load, ...]:
        return self.steps[self._index(step)]

    def start_state(self, step: int) -> dict[int, int]:
        return self.states[self._index(step)]

    def _index(self, step: int) -> int:
        if step < len(self.steps):
            return step
        period = len(self.steps) - self.loop
        return self.loop + (step - self.loop) % period

    @property
    def streamed(self) -> tuple[int, ...]:
        """Blocks that ever leave the ring: they need a host copy."""
        out = {ld.block for loads in self.steps for ld in loads}
        return tuple(sorted(out))

    @property
    def resident_bytes(self) -> int:
        return self.capacity

    def bytes_per_step(self) -> int:
        """Host-to-device bytes of one steady-state step (averaged over the loop)."""
        loop = self.steps[self.loop :]
        return sum(self.sizes[ld.block] for loads in loop for ld in loads) // max(1, len(loop))


def sequence_for(mode: str, n: int) -> tuple[tuple[str, int], ...]:
    if mode == "train":
        return tuple((FWD, i) for i in range(n)) + tuple((BWD, i) for i in reversed(range(n)))
    if mode == "sample":
        return tuple((FWD, i) for i in range(n))
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def capacity_for(sizes: list[int] | tuple[int, ...], fraction: float, min_blocks: int = 2) -> int:
    """Ring bytes for an offload `fraction` (share of block bytes kept in CPU RAM).

    The GPU keeps the first blocks (in execution order) whose sizes add up to at most (1 - fraction) of the
    total, so a fraction is rounded to whole blocks the way the seed counts them (33% of 9 blocks: 6 stay).
    Streaming needs room for at least `min_blocks` of the largest block (one computing, one arriving)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload fraction must be in [0, 1], got {fraction}")
    total = sum(sizes)
    budget = (1.0 - fraction) * total + 1e-9 * total
    acc = 0
    for s in sizes:
        if acc + s > budget:
            break
        acc += s
    if acc == total:
        return total
    return min(total, max(acc, min_blocks * max(sizes)))


def _place(ptr: int, n: int, direction: int, cap: int, base: int = 0) -> tuple[int, int]:
    """Region start for n bytes at the pointer, wrapping inside [base, cap); returns (start, new pointer)."""
    if direction > 0:
        start = ptr if ptr + n <= cap else base
        return start, start + n
    start = ptr - n if ptr - n >= base else cap - n
    return start, start


def spread_fixed(sizes: list[int] | tuple[int, ...], capacity: int, min_blocks: int = 2) -> frozenset[int]:
    """Blocks to keep resident for cyclic sampling, chosen so that the streamed bytes are spread evenly over
    the execution order.

    The seed's cyclic schedule streams every block through the whole ring, so a sampling step moves all W
    bytes whatever the fraction. When part of the model fits, keeping that part resident and streaming only
    the rest through a window of `min_blocks` largest blocks moves about f W bytes a step instead (the
    DESIGN.md floor). Those bytes hide behind compute only if they arrive at an even rate: the window lets
    the copies run at most one block ahead, so a stretch where streamed bytes outpace compute stalls. DiT
    blocks all see the same tokens and do about the same work, whatever their bytes (Flux's double blocks
    hold 2.4 x the bytes of its single blocks for about the same FLOPs), so the evenness is by *position*:
    walking the blocks in order, a block streams when the streamed bytes up to and including it stay within
    an even share per block so far (a copy is due when its block starts, so the streamed bytes never run
    ahead of that share), otherwise it stays, while the resident budget lasts. Spreading by bytes instead
    streams 11 of Flux's 19 double blocks, whose copies outrun the double blocks' compute (replayed in
    tests/test_offload_plan.py: 1.12 x the resident forward at f=0.5, measured 1.10 x; by position 1.00 x
    replayed, 1.02-1.03 x measured)."""
    total = sum(sizes)
    if capacity >= total:
        return frozenset(range(len(sizes)))
    budget = capacity - min_blocks * max(sizes)
    if budget <= 0:
        return frozenset()
    share = (total - budget) / len(sizes)  # streamed bytes per block if spread evenly
    fixed, used, streamed = set(), 0, 0
    for i, s in enumerate(sizes):
        if streamed + s <= share * (i + 1) or used + s > budget:
            streamed += s
        else:
            fixed.add(i)
            used += s
    return frozenset(fixed)


def make_plan(
    sizes: list[int] | tuple[int, ...],
    capacity: int,
    mode: str,
    max_steps: int = 64,
    fixed: frozenset[int] | set[int] = frozenset(),
    held: frozenset[int] | set[int] = frozenset(),
) -> Plan:
    """Simulate the ring until its state at a step boundary repeats; see the module docstring.

    `fixed` blocks sit at the start of the ring for good; `held` ones are on the device outside the ring (never
    loaded, no ring bytes: `held_plan`); the others stream through the rest of it. The ring
    starts filled (`_Ring.fill`), runs whole steps until a step starts as an earlier one did (`_Ring.run`), and
    its loads are then grouped by the step their release point falls in (`_loads_per_step`)."""
    sizes = tuple(int(s) for s in sizes)
    if not sizes:
        raise ValueError("no blocks")
    if max(sizes) > capacity:
        raise PlanError(f"ring of {capacity} bytes is smaller than the largest block ({max(sizes)} bytes)")
    seq = sequence_for(mode, len(sizes))
    ring = _Ring(sizes, capacity, seq, frozenset(fixed), frozenset(held))
    initial = ring.fill()
    loop, nsteps = ring.run(max_steps)
    for ld in ring.loads:  # loads with after == -1 fit in free space at the start: they join the initial state
        if ld.after < 0:
            initial[ld.block] = ld.offset
    return Plan(
        mode=mode,
        sizes=sizes,
        capacity=capacity,
        sequence=seq,
        initial=initial,
        steps=_loads_per_step(ring.loads, nsteps, len(seq)),
        loop=loop,
        states=tuple(ring.states[:nsteps]),
        fixed=frozenset(fixed),
        held=frozenset(held),
    )


class _Ring:
    """The ring while `make_plan` simulates it: where each block sits, the moving pointer, each block's last use
    and the loads issued so far. Positions count executions from the first step on (`t`)."""

    def __init__(self, sizes: tuple[int, ...], capacity: int, seq: tuple[tuple[str, int], ...],
                 fixed: frozenset[int], held: frozenset[int] = frozenset()):
        self.sizes, self.capacity, self.seq, self.fixed = sizes, capacity, seq, fixed | held
        self.held = held  # in `fixed` for the walk (never loaded), but given no ring bytes
        self.fixed_at: dict[int, int] = {}  # fixed block -> ring offset
        self.base = 0  # end of the fixed blocks: the streamed ones wrap inside [base, capacity)
        self.res: dict[int, tuple[int, int]] = {}  # streamed block -> (offset, loaded_for position)
        self.ptr = 0
        self.last_use: dict[int, int] = {}
        self.last_after = -1  # the latest release point a load waited for: loads are issued in order
        self.loads: list[Load] = []
        self.states: list[dict[int, int]] = []  # residency at the start of each step before the repeat
        self.t = 0  # the position: executions since the start of the first step

    def fill(self) -> dict[int, int]:
        """The state before the first step, {block: offset}: the fixed blocks first, then the others in
        first-use order, packed upwards while they fit."""
        for b in sorted(self.fixed - self.held):
            self.fixed_at[b] = self.base
            self.base += self.sizes[b]
        streamed = [b for b in range(len(self.sizes)) if b not in self.fixed]
        if any(self.sizes[b] > self.capacity - self.base for b in streamed):
            raise PlanError(
                f"ring of {self.capacity} bytes leaves too little room beside the {self.base} fixed bytes"
            )
        self.ptr = self.base
        for _, b in self.seq:
            if b in self.res or b in self.fixed:
                continue
            if self.ptr + self.sizes[b] > self.capacity:
                break
            self.res[b] = (self.ptr, 0)
            self.ptr += self.sizes[b]
        return {**self.fixed_at, **{b: off for b, (off, _) in self.res.items()}}

    def run(self, max_steps: int) -> tuple[int, int]:
        """Run whole steps until one starts in the state an earlier one started in, then two more so that loads
        released in the last step but used in the next are known; returns (the earlier step: where the loop
        starts, the step that repeats it). At most max_steps + 3 steps are simulated, the two after the repeat
        counted (a repeat found at the last one runs only one more)."""
        limit = max_steps + 3
        seen: dict[tuple, int] = {}
        for step in range(limit):
            key = self._key(step)
            if key in seen:
                for _ in range(min(2, limit - step)):
                    self._step()
                return seen[key], step
            seen[key] = step
            self.states.append({**self.fixed_at,
                                **{b: off for b, (off, _) in self.res.items()}})
            self._step()
        raise PlanError(f"schedule did not become periodic within {max_steps} steps")

    def _key(self, step: int) -> tuple:
        """The state at the start of `step`, positions relative to it: the pointer, the last release point, and
        each resident block's offset, whether it has been used since it was loaded and its last use."""
        L = len(self.seq)
        return (
            self.ptr,
            self.last_after - step * L if self.last_after >= 0 else None,
            tuple(
                sorted(
                    (b, off, self.last_use.get(b, -1) >= lf, self.last_use.get(b, -(10**9)) - step * L)
                    for b, (off, lf) in self.res.items()
                )
            ),
        )

    def _step(self) -> None:
        """One step of the sequence: each block that is needed but not resident is loaded (`_load`)."""
        for _ in range(len(self.seq)):
            pas, b = self.seq[self.t % len(self.seq)]
            if b not in self.res and b not in self.fixed:
                self._load(pas, b)
            self.last_use[b] = self.t
            self.t += 1

    def _load(self, pas: str, b: int) -> None:
        """Place block `b` at the pointer (upwards in forward, downwards in backward, wrapping); it claims the
        blocks it overlaps, and its copy waits until each has passed its last use."""
        start, new_ptr = _place(self.ptr, self.sizes[b], 1 if pas == FWD else -1, self.capacity, self.base)
        end = start + self.sizes[b]
        claimed = [x for x, (off, _) in self.res.items() if off < end and start < off + self.sizes[x]]
        after = self.last_after
        for x in claimed:
            _, loaded_for = self.res[x]
            if loaded_for >= self.t or x not in self.last_use or self.last_use[x] < loaded_for:
                raise PlanError(
                    f"ring of {self.capacity} bytes too small: loading block {b} would evict block {x} "
                    "before it is used"
                )
            after = max(after, self.last_use[x])
        for x in claimed:
            del self.res[x]
        self.res[b] = (start, self.t)
        self.ptr = new_ptr
        self.loads.append(Load(b, start, after, self.t, tuple(sorted(claimed))))
        self.last_after = after


def _loads_per_step(loads: list[Load], nsteps: int, L: int) -> tuple[tuple[Load, ...], ...]:
    """The loads of the first `nsteps` steps, each in the step its release point falls in, with positions
    relative to that step; loads before the first step (after == -1) are left to the initial state."""
    per_step: list[list[Load]] = [[] for _ in range(nsteps)]
    for ld in loads:
        if ld.after < 0:
            continue
        s = ld.after // L
        if s >= nsteps:
            continue
        per_step[s].append(Load(ld.block, ld.offset, ld.after - s * L, ld.use - s * L, ld.claims))
    return tuple(tuple(s) for s in per_step)


def plan_for(sizes: list[int] | tuple[int, ...], capacity: int, mode: str, min_blocks: int = 2) -> Plan:
    """The plan the conductor runs: the seed's schedule for training; for sampling the seed's cycle or, when
    it moves fewer bytes, a spread resident part plus a streaming window (`spread_fixed`)."""
    plan = make_plan(sizes, capacity, mode)
    if mode == "sample":
        fixed = spread_fixed(sizes, capacity, min_blocks)
        if fixed:
            alt = make_plan(sizes, capacity, mode, fixed=fixed)
            if alt.bytes_per_step() < plan.bytes_per_step():
                plan = alt
    return plan



def held_plan(plan: Plan, held_bytes: int) -> Plan:
    """A sampling `plan` with up to `held_bytes` more of its blocks on the device: as many of its streamed blocks
    as fit in them (in block order, each whole) held outside the ring, the rest streaming through the same ring
    beside the same fixed blocks at the same offsets. So the conductor switches to it and back without moving a
    fixed block (`Conductor.hold`): each held block is copied once from its host bytes, and each step then moves
    that many bytes fewer. `plan` itself where nothing fits, or where the variant would load or move a block that
    `plan` never streams (one without host bytes: a block a cyclic plan never evicts)."""
    if plan.mode != "sample":
        raise ValueError("held_plan: a sampling plan (cyclic forward) only")
    held, used = set(), 0
    for b in plan.streamed:
        if used + plan.sizes[b] <= held_bytes:
            held.add(b)
            used += plan.sizes[b]
    if not held:
        return plan
    alt = make_plan(plan.sizes, plan.capacity, plan.mode, fixed=plan.fixed, held=held)
    streamed = set(plan.streamed)
    if not set(alt.streamed) <= streamed or any(alt.initial.get(b) != off for b, off in plan.initial.items()
                                                 if b not in streamed):
        return plan
    return alt


# ------------------------------------------------------------------------------------ diagrams (tests, docs)


def residency_rows(plan: Plan, steps: int = 1) -> list[tuple[str, int, dict[int, int]]]:
    """Idealised view of the seed's diagrams: for each execution, (pass, block, {block: offset} in VRAM).

    A load counts as done, and the blocks it claims as gone, from the position after its release point."""
    L = len(plan.sequence)
    state = dict(plan.initial)
    pending: list[tuple[int, Load]] = []  # (global after, load)
    rows = []
    for s in range(steps):
        for ld in plan.step_loads(s):
            pending.append((s * L + ld.after, ld))
        for i, (pas, b) in enumerate(plan.sequence):
            t = s * L + i
            for _g, ld in [p for p in pending if p[0] < t]:
                for x in ld.claims:
                    state.pop(x, None)
                state[ld.block] = ld.offset
            pending = [p for p in pending if p[0] >= t]
            rows.append((pas, b, dict(state)))
    return rows


def execution_diagram(plan: Plan, steps: int = 1) -> list[str]:
    """Rows like the seed's execution diagrams: '->  ■ X X _'."""
    n = len(plan.sizes)
    out = []
    for pas, b, state in residency_rows(plan, steps):
        cells = ["■" if i == b else ("X" if i in state else "_") for i in range(n)]
        out.append(("->  " if pas == FWD else "<-  ") + " ".join(cells))
    return out


def allocation_diagram(plan: Plan, steps: int = 1) -> list[str]:
    """Rows like the seed's allocation diagram (equal block sizes): slot contents, '*07*' = executing."""
    slot = plan.sizes[0]
    nslots = plan.capacity // slot
    out = []
    for pas, b, state in residency_rows(plan, steps):
        cells = []
        for k in range(nslots):
            who = [x for x, off in state.items() if off == k * slot]
            label = f"{who[0]:02d}" if who else "  "
            cells.append(f"*{label}*" if who and who[0] == b else f" {label} ")
        out.append(("->  " if pas == FWD else "<-  ") + "".join(cells).rstrip())
    return out
