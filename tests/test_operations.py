"""The operations executor: stage splitting, column-major order, state rules, batch splitting, overlap."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from itertools import combinations_with_replacement, pairwise

import pytest

from afd_engine.operations import (
    DuplicateStateError,
    LeftoverStateError,
    MicroBatchState,
    MissingStateError,
    Operation,
    YieldOperation,
    repeat_layers,
    run_micro_batches,
    schedule,
    split_micro_batches,
    split_stages,
)

Y = YieldOperation()


def nop(name: str) -> Operation:
    """An operation that only shows up in the trace."""
    return Operation(name, lambda state: None)


def trace_of(ops, n: int, delays=None) -> list[tuple]:
    trace: list = []
    run_micro_batches(ops, [{} for _ in range(n)], delays=delays, trace=trace)
    return [tuple(event) for event in trace]


# ---------------------------------------------------------------- stages


def test_split_stages_markers_are_separators():
    def attn(state):
        pass

    a, b = nop("a"), nop("b")
    assert split_stages([a, Y, b]) == [(a,), (b,)]
    assert split_stages([a, Y, Y, b]) == [(a,), (), (b,)]  # two markers: explicit nop stage
    assert split_stages([Y, a]) == [(), (a,)]  # leading marker: empty first stage
    assert split_stages([a, YieldOperation]) == [(a,), ()]  # the class works as a marker too
    assert split_stages([]) == [()]
    (stage,) = split_stages([attn])
    assert stage[0].name == "attn" and stage[0].fn is attn  # plain functions keep their name


def test_split_stages_rejects_non_callables():
    with pytest.raises(TypeError, match="callable"):
        split_stages([nop("a"), 3])


def test_repeat_layers_concatenates_so_stages_span_layers():
    ops = repeat_layers(lambda layer: [nop(f"shared{layer}"), Y, nop(f"attn{layer + 1}")], 2)
    names = [[op.name for op in stage] for stage in split_stages(ops)]
    assert names == [["shared0"], ["attn1", "shared1"], ["attn2"]]


def test_schedule_is_column_major():
    assert [tuple(s) for s in schedule(2, [0, 1])] == [(0, 0, 0), (1, 0, 1), (1, 1, 0), (2, 1, 1)]


# ---------------------------------------------------------------- execution order

ABC = [nop("a"), Y, nop("b"), Y, nop("c")]


def test_order_one_micro_batch():
    assert trace_of(ABC, 1) == [(0, 0, "a"), (0, 1, "b"), (0, 2, "c")]
    assert trace_of(ABC, 1, delays=[2]) == [(0, 2, "a"), (0, 3, "b"), (0, 4, "c")]


def test_order_two_micro_batches():
    assert trace_of(ABC, 2) == [
        (0, 0, "a"),
        (1, 0, "a"),
        (0, 1, "b"),
        (1, 1, "b"),
        (0, 2, "c"),
        (1, 2, "c"),
    ]
    assert trace_of(ABC, 2, delays=[0, 1]) == [
        (0, 0, "a"),
        (0, 1, "b"),
        (1, 1, "a"),
        (0, 2, "c"),
        (1, 2, "b"),
        (1, 3, "c"),
    ]


def test_order_three_micro_batches():
    assert trace_of(ABC, 3, delays=[1, 1, 1]) == [  # an equal delay only shifts the columns
        (0, 1, "a"),
        (1, 1, "a"),
        (2, 1, "a"),
        (0, 2, "b"),
        (1, 2, "b"),
        (2, 2, "b"),
        (0, 3, "c"),
        (1, 3, "c"),
        (2, 3, "c"),
    ]
    assert trace_of(ABC, 3, delays=[0, 1, 2]) == [
        (0, 0, "a"),
        (0, 1, "b"),
        (1, 1, "a"),
        (0, 2, "c"),
        (1, 2, "b"),
        (2, 2, "a"),
        (1, 3, "c"),
        (2, 3, "b"),
        (2, 4, "c"),
    ]


def test_order_with_nop_and_leading_empty_stages():
    # Stages: a | (nop) | b c | (empty, from the trailing marker).
    ops = [nop("a"), Y, Y, nop("b"), nop("c"), Y]
    assert trace_of(ops, 3, delays=[0, 1, 2]) == [
        (0, 0, "a"),
        (1, 1, "a"),  # column 1: micro-batch 0 is in its nop stage
        (0, 2, "b"),
        (0, 2, "c"),
        (2, 2, "a"),
        (1, 3, "b"),
        (1, 3, "c"),
        (2, 4, "b"),
        (2, 4, "c"),
    ]
    assert trace_of([Y, nop("a"), Y, nop("b")], 2) == [(0, 1, "a"), (1, 1, "a"), (0, 2, "b"), (1, 2, "b")]


def test_pre_split_stages_run_the_same():
    stages = split_stages(ABC + [Y, Y, nop("d")])
    assert trace_of(stages, 2, delays=[1, 0]) == trace_of(ABC + [Y, Y, nop("d")], 2, delays=[1, 0])


# ---------------------------------------------------------------- the FFN-side layout (seed 3BO)


def ffn_layer(layer: int, num_micro_batches: int) -> list:
    """[recv] [mlp] [combine] + N-2 nop stages; with delays [0..N-1] this gives the seed's order."""
    return [nop(f"recv{layer}"), Y, nop(f"mlp{layer}"), Y, nop(f"combine{layer}"), Y] + [Y] * (num_micro_batches - 2)


def test_ffn_layout_literal_trace_three_micro_batches():
    ops = repeat_layers(lambda layer: ffn_layer(layer, 3), 2)
    assert trace_of(ops, 3, delays=[0, 1, 2]) == [
        (0, 0, "recv0"),
        (0, 1, "mlp0"),
        (1, 1, "recv0"),
        (0, 2, "combine0"),
        (1, 2, "mlp0"),
        (2, 2, "recv0"),
        (1, 3, "combine0"),
        (2, 3, "mlp0"),  # micro-batch 0 is in its nop stage
        (0, 4, "recv1"),
        (2, 4, "combine0"),
        (0, 5, "mlp1"),
        (1, 5, "recv1"),
        (0, 6, "combine1"),
        (1, 6, "mlp1"),
        (2, 6, "recv1"),
        (1, 7, "combine1"),
        (2, 7, "mlp1"),
        (2, 8, "combine1"),
    ]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ffn_layout_recv_of_next_between_previous_combines(n):
    layers = 3
    trace = trace_of(repeat_layers(lambda layer: ffn_layer(layer, n), layers), n, delays=list(range(n)))
    at = {(mb, name): i for i, (mb, _, name) in enumerate(trace)}

    def pos(kind: str, step: int) -> int:
        # Micro-batch steps in pipeline order: (layer 0, mb 0), (0, 1), ..., (0, n-1), (1, 0), ...
        return at[(step % n, f"{kind}{step // n}")]

    for step in range(n * layers):
        assert pos("recv", step) < pos("mlp", step) < pos("combine", step)
        if step + 1 < n * layers:
            assert pos("recv", step + 1) < pos("combine", step), "next receive must be posted before this combine"
        if step >= 1 and step + 1 < n * layers:
            assert pos("combine", step - 1) < pos("recv", step + 1), "next receive must wait for the previous combine"


def test_ffn_layout_needs_staggered_delays():
    # An equal delay for all rows only shifts columns: recv of mb 2 then comes before combine of mb 0.
    trace = trace_of(repeat_layers(lambda layer: ffn_layer(layer, 3), 1), 3, delays=[1, 1, 1])
    at = {(mb, name): i for i, (mb, _, name) in enumerate(trace)}
    assert at[(2, "recv0")] < at[(0, "combine0")]


# ---------------------------------------------------------------- state


def test_values_flow_within_one_micro_batch_only():
    seen = []

    def scale(state):
        seen.append(state.micro_batch)
        state.set("x", state.pop("inp") * 10)

    def finish(state):
        state.set_output((state.micro_batch, state.pop("x") + 1))

    outputs = run_micro_batches([scale, Y, finish], [{"inp": 1}, {"inp": 2}, {"inp": 3}], delays=[2, 0, 1])
    assert outputs == [(0, 11), (1, 21), (2, 31)]
    assert seen == [1, 2, 0]  # delays [2, 0, 1]: column 0 is mb 1's, column 1 mb 2's, column 2 mb 0's


def test_no_output_gives_none():
    assert run_micro_batches([lambda state: state.pop("x")], [{"x": 1}, {"x": 2}]) == [None, None]


def test_leftover_state_names_keys_and_micro_batch():
    def consume(state):
        state.pop("hidden")

    with pytest.raises(LeftoverStateError, match=r"micro-batch 1 still holds \['extra'\]") as err:
        run_micro_batches([consume], [{"hidden": 0}, {"hidden": 1, "extra": 2}])
    assert err.value.leftovers == {1: ("extra",)}


def test_pop_of_a_missing_key_is_a_clear_error():
    def needs_residual(state):
        state.pop("residual")

    with pytest.raises(MissingStateError, match="micro-batch 0 holds no 'residual'") as err:
        run_micro_batches([needs_residual], [{"hidden": 1}])
    assert isinstance(err.value, KeyError)
    assert any("'needs_residual' of micro-batch 0" in note for note in err.value.__notes__)


def test_state_set_twice_and_accessors():
    state = MicroBatchState(2, {"a": 1})
    with pytest.raises(DuplicateStateError, match="micro-batch 2 already holds 'a'"):
        state.set("a", 5)
    assert "a" in state and state.get("a") == 1 and state["a"] == 1 and state.get("b", 7) == 7
    with pytest.raises(MissingStateError, match="micro-batch 2 holds no 'b'"):
        state["b"]
    assert state.pop("a") == 1 and len(state) == 0


@pytest.mark.parametrize(
    "inputs, delays, message",
    [
        ([], None, "at least one micro-batch"),
        ([{}, {}], [0], "got 1 delays for 2 micro-batches"),
        ([{}, {}], [0, -1], "integers >= 0"),
    ],
)
def test_invalid_runs_are_rejected(inputs, delays, message):
    with pytest.raises(ValueError, match=message):
        run_micro_batches(ABC, inputs, delays=delays)


# ---------------------------------------------------------------- splitting a batch


def totals(counts, ranges):
    return [sum(counts[i] for i in r) for r in ranges]


@pytest.mark.parametrize(
    "counts, n, expected",
    [
        ([1, 1, 1, 1], 3, [range(0, 1), range(1, 3), range(3, 4)]),
        ([3, 1, 1, 1, 3, 1], 2, [range(0, 3), range(3, 6)]),
        ([5, 1, 1, 1, 1, 1], 2, [range(0, 1), range(1, 6)]),
        ([0, 2, 5, 3, 3, 13], 4, [range(0, 3), range(3, 4), range(4, 5), range(5, 6)]),
        ([7, 9], 1, [range(0, 2)]),
    ],
)
def test_split_hand_cases(counts, n, expected):
    assert split_micro_batches(counts, n) == expected


@pytest.mark.parametrize(
    "counts, n, expected",
    [
        ([5], 3, [range(0, 0), range(0, 1), range(1, 1)]),  # fewer sequences than micro-batches
        ([], 3, [range(0, 0)] * 3),
        ([0, 0, 0], 3, [range(0, 1), range(1, 2), range(2, 3)]),  # zero tokens: spread the sequences
        ([4, 4], 4, [range(0, 0), range(0, 1), range(1, 1), range(1, 2)]),
    ],
)
def test_split_empty_micro_batches(counts, n, expected):
    assert split_micro_batches(counts, n) == expected


def test_split_is_optimal_against_brute_force():
    import random

    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(0, 7))]
        n = rng.randint(1, 4)
        ranges = split_micro_batches(counts, n)
        assert len(ranges) == n and [i for r in ranges for i in r] == list(range(len(counts)))
        got = totals(counts, ranges)
        best = min((max(s), max(s) - min(s)) for s in _all_splits(counts, n))
        assert (max(got), max(got) - min(got)) == best, (counts, n, got)


def _all_splits(counts, n):
    for cuts in combinations_with_replacement(range(len(counts) + 1), n - 1):
        bounds = [0, *cuts, len(counts)]
        yield [sum(counts[a:b]) for a, b in pairwise(bounds)]


def test_split_repeats_give_fresh_lists_and_errors():
    first = split_micro_batches([1, 1, 1, 1], 3)
    first.append(range(9))  # the caller's own list: the next caller does not see this
    assert split_micro_batches([1, 1, 1, 1], 3) == [range(0, 1), range(1, 3), range(3, 4)]
    for _ in range(2):  # a remembered input is not a remembered error, nor the reverse
        with pytest.raises(ValueError, match=">= 0"):
            split_micro_batches([1, -1], 2)


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError, match=">= 1"):
        split_micro_batches([1], 0)
    with pytest.raises(ValueError, match=">= 0"):
        split_micro_batches([1, -1], 2)


# ---------------------------------------------------------------- overlap: 3 micro-batches hide what 2 cannot

T_ATTN, T_REMOTE, LAYERS = 0.02, 0.03, 6


def a_side_busy_fraction(n: int) -> float:
    """A side of L layers: per layer one stage [combine(l-1) wait, attention(l), dispatch(l)].

    dispatch submits a fake F + comm round trip that completes T_REMOTE later; combine waits on it.
    Between a micro-batch's dispatch and its next combine the other n-1 micro-batches attend, so
    A idles per column max(0, T_REMOTE - (n-1) * T_ATTN):
      n=2: column 0 takes 2*T_ATTN; columns 1..L-1 each T_REMOTE + T_ATTN = 50 ms (10 ms idle
           waiting for mb 0's combine); the last combine lands T_REMOTE after the last attention:
           wall = 40 + 5*50 + 30 = 320 ms, busy 2*L*T_ATTN = 240 ms -> 0.75.
      n=3: 2*T_ATTN = 40 ms >= T_REMOTE, so A never waits until the final combine:
           wall = 3*L*T_ATTN + T_REMOTE = 390 ms, busy 360 ms -> 0.92.
    """
    busy = 0.0

    def attention(state):
        nonlocal busy
        start = time.perf_counter()
        time.sleep(T_ATTN)
        busy += time.perf_counter() - start
        state.set("hidden", state.pop("hidden") + 1)

    def remote(hidden):
        time.sleep(T_REMOTE)
        return hidden * 2

    def dispatch(state):
        state.set("in_flight", pool.submit(remote, state.pop("hidden")))

    def combine(state):
        state.set("hidden", state.pop("in_flight").result())

    def layer_ops(layer):
        return ([combine] if layer else []) + [attention, dispatch, Y]

    def finish(state):
        combine(state)
        state.set_output(state.pop("hidden"))

    with ThreadPoolExecutor(max_workers=n) as pool:
        start = time.perf_counter()
        outputs = run_micro_batches(repeat_layers(layer_ops, LAYERS) + [finish], [{"hidden": m} for m in range(n)])
        wall = time.perf_counter() - start
    expected = list(range(n))
    for _ in range(LAYERS):
        expected = [(h + 1) * 2 for h in expected]
    assert outputs == expected
    return busy / wall


def best_of_three(n: int, ok) -> list[float]:
    # Load on the machine stretches sleeps: a retry takes the least disturbed of up to 3 runs.
    fractions = []
    for _ in range(3):
        fractions.append(a_side_busy_fraction(n))
        if ok(fractions[-1]):
            break
    return fractions


def test_three_micro_batches_hide_a_slow_remote_stage_that_two_cannot():
    three = best_of_three(3, lambda f: f >= 0.85)
    two = best_of_three(2, lambda f: f <= 0.8)
    assert max(three) >= 0.85, three
    assert min(two) <= 0.8, two
