"""The loop_spec tuner: measures the model's top candidates (or a conv's / batch GEMM's
short list), persists, reuses, and its CLI."""

import re
import time

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import tvm_tpp
from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import Machine, machine_of
from schedules import batch_gemm, conv, gemm, search
from schedules.gemm import GemmConfig, GemmProblem, pack_weight, schedule
from schedules.measure import flush_operands
from schedules.ops import MODEL_RESOLUTION, OPS, op_of
from schedules.tuner import (
    MARGIN,
    Database,
    Tuner,
    TuningKey,
    build,
    config_for,
    config_text,
    time_interleaved,
    tune,
)
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime

TARGET = tvm_tpp.target("tpp -isa=avx2 -mcpu=haswell -num-cores=1")
PROBLEM = GemmProblem(48, 64, 96)
BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
CONV = conv.ConvProblem(2, 6, 9, 14, 16, 3, 3, padding=1, epilogue=BIAS_RELU)
BATCH_GEMM = batch_gemm.BatchGemmProblem(2, 24, 40, 16, b_transposed=True,
                                         epilogue=Epilogue((EpilogueOp("scale", value=0.5),)))
#: The default the tuner measures first for PROBLEM on TARGET.
DEFAULT = gemm.default_config(PROBLEM, machine_of(TARGET))
#: A small L2 (64 KiB), where a K of 1024 is long.
SMALL_L2 = isa.Caches(32 * 1024, 64 * 1024, 1 << 20)


def _machine(threads: int, caches: isa.Caches = isa.DEFAULT_CACHES) -> Machine:
    """An AVX2 machine at its nominal peak: the model's rankings do not depend on the host."""
    return Machine(isa.from_name("avx2"), caches, threads, fp32_flops_per_cycle=32.0)


def test_tune_persists_and_second_call_is_free(tmp_path):
    db = Database(tmp_path / "tuning.db")
    result = tune(PROBLEM, TARGET, database=db, top_k=2)
    assert not result.cached and result.candidates > 2
    assert result.best in [m.config for m in result.measurements if m.seconds]
    default = DEFAULT
    assert default in [m.config for m in result.measurements]  # the default is always measured
    key = TuningKey.of(PROBLEM, TARGET).text()
    record = Database(tmp_path / "tuning.db").record(TuningKey.of(PROBLEM, TARGET))
    assert record["config"]["spec"] == result.best.spec and record["gflops"] > 0
    assert Database(tmp_path / "tuning.db").keys() == [key]

    again = tune(PROBLEM, TARGET, database=Database(tmp_path / "tuning.db"))
    assert again.cached and again.tune_seconds == 0 and again.best == result.best


def test_tuned_config_is_correct(tmp_path):
    best = tune(PROBLEM, TARGET, database=Database(tmp_path / "t.db"), top_k=2).best
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 96)).astype("float32")
    w = rng.standard_normal((96, 64)).astype("float32")
    f = tvm.compile(schedule(PROBLEM, best, "avx2").mod, target=TARGET)
    y = tvm.runtime.empty((48, 64), "float32")
    f(tvm.runtime.tensor(x), tvm.runtime.tensor(pack_weight(w, best.bn)), y)
    np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-4, atol=1e-4)


def test_a_record_tuned_against_an_older_default_is_tuned_again(tmp_path, monkeypatch):
    """After the default changed, builds use today's default, and the next tuning measures
    it with the old winner among the candidates; the new winner replaces the record."""
    db = Database(tmp_path / "tuning.db")
    key = TuningKey.of(PROBLEM, TARGET)
    old_default, *others = [c for c in _ranked(8) if c != DEFAULT]
    old_winner = others[-1]
    db.put(key, old_winner, measured=[{"config": OPS["dense"].to_json(old_default)}])
    tuner = Tuner(db)
    assert tuner.config(PROBLEM, TARGET) is None
    assert config_for(PROBLEM, TARGET, tuner) == DEFAULT
    calls = []
    _fake_measure(monkeypatch, lambda c, final: 0.5 if c == old_winner else 1.0, calls)
    result = tune(PROBLEM, TARGET, database=db, top_k=1)
    assert not result.cached and calls[0][:2] == [DEFAULT, old_winner]
    assert result.best == old_winner and tuner.config(PROBLEM, TARGET) == old_winner


def test_lookup_only_tuner_returns_none_for_unknown(tmp_path):
    tuner = Tuner(Database(tmp_path / "t.db"))
    assert tuner.config(PROBLEM, TARGET) is None
    assert config_for(PROBLEM, TARGET, tuner) == DEFAULT
    with pytest.raises(TypeError, match="takes a Database"):
        Tuner(tmp_path / "t.db")


def test_corrupt_database_is_set_aside(tmp_path, caplog):
    path = tmp_path / "t.db"
    path.write_text("{not json")
    assert len(Database(path)) == 0
    assert (tmp_path / "t.db.corrupt").read_text() == "{not json"
    assert "is not a tuning database: moved it to t.db.corrupt" in caplog.text


def test_tune_cli_explain(tmp_path, dense_file, capsys):
    from tvm_tpp.cli import main

    assert main(["tune", str(dense_file), "--work-dir", str(tmp_path), "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert "model ranking vs measurement" in out and "top 5 classes" in out
    assert re.search(r"measured best is model rank \d+, class \d+; in the model's top 5", out)
    assert (tmp_path / "tuning.db").is_file()


def _fake_measure(monkeypatch, seconds_of, calls=None, delay=0.0):
    """Replace building and timing by ``seconds_of(config, final)`` (``final``: a call of the
    final round, which passes its rounds); record each call's configs."""

    def fake(problem, configs, target, isa, **options):
        if calls is not None:
            calls.append(list(configs))
        time.sleep(delay)
        return [seconds_of(c, "rounds" in options) for c in configs]

    monkeypatch.setattr(search, "measure", fake)


def _ranked(top_k):
    """The default and the candidates ``tune(PROBLEM, TARGET, top_k=top_k)`` measures, in
    measuring order."""
    choices, _ = op_of(PROBLEM).choices(PROBLEM, machine_of(TARGET), 400)
    return [c.config for c in choices[:1 + top_k]]


@pytest.mark.parametrize("speedup,wins", [(MARGIN / 2, False), (3 * MARGIN, True)])
def test_candidate_must_beat_default_by_margin(monkeypatch, speedup, wins):
    default, first, *_ = _ranked(6)
    _fake_measure(monkeypatch, lambda c, final: {default: 1.0, first: 1.0 - speedup}.get(c, 2.0))
    assert tune(PROBLEM, TARGET, top_k=6).best == (first if wins else default)


@pytest.mark.parametrize("final, wins", [(0.995, False), (0.9, True)])
def test_winner_must_beat_the_default_again_in_the_final_round(monkeypatch, final, wins):
    default, winner, *others = _ranked(4)
    calls = []
    _fake_measure(monkeypatch, lambda c, last: (final if last else 0.9) if c == winner
                  else 1.0 if c == default else 2.0, calls)
    result = tune(PROBLEM, TARGET, top_k=4)
    # The default, then every timed candidate, fastest first; in two halves.
    assert calls[-1] == calls[-2] == [default, winner, *others] and len(calls) == 3
    assert result.best == (winner if wins else default)
    # Contenders' records take the final round's times: equal samples for each.
    assert [m.seconds for m in result.measurements[:2]] == [1.0, final]


def test_final_round_is_fair_to_candidates_timed_once(monkeypatch):
    # The default, re-timed with every batch, once measured 0.95 (luck); the candidate
    # measured 0.99 in its only batch.  Side by side in the final round it is 5 % faster.
    default, *_, late = _ranked(search.BATCH + 1)
    retimed = iter([1.0, 0.95])

    def seconds_of(config, final):
        if config == default:
            return 1.0 if final else next(retimed)
        return (0.95 if final else 0.99) if config == late else 2.0

    _fake_measure(monkeypatch, seconds_of)
    result = tune(PROBLEM, TARGET, top_k=search.BATCH + 1)
    assert result.best == late
    assert result.measurements[0].seconds == 1.0 and result.measurements[-1].seconds == 0.95


def test_final_round_takes_candidates_a_busy_batch_slowed(monkeypatch):
    # A candidate measured 3x slower than it is in its batch (the machine was busy) still
    # contends in the final round, and wins there.
    default, *_, unlucky = _ranked(4)
    _fake_measure(monkeypatch, lambda c, final: 1.0 if c == default
                  else (0.8 if final else 3.0) if c == unlucky else 2.0)
    assert tune(PROBLEM, TARGET, top_k=4).best == unlucky


@pytest.mark.parametrize("later, wins", [(0.95, "first"), (0.90, "later")])
def test_final_round_ties_go_to_the_earlier_candidate(monkeypatch, later, wins):
    """Two candidates beat the default; the later one measures faster than the earlier.
    Within MARGIN of each other they are a tie the timer cannot break, and the earlier
    (in measuring order) wins it, as it would on a rerun; beyond it the faster wins."""
    default, first, second, *_ = _ranked(4)
    _fake_measure(monkeypatch, lambda c, final: {
        default: 1.0, first: 0.96, second: later if final else 0.97}.get(c, 2.0))
    result = tune(PROBLEM, TARGET, top_k=4)
    assert result.best == {"first": first, "later": second}[wins]
    assert result.tie_margin == MARGIN  # the halves agree: no noise beyond the margin


@pytest.mark.parametrize("disagree, wins", [(0.0, "candidate"), (0.12, "default")])
def test_noisy_halves_widen_the_tie(monkeypatch, disagree, wins):
    """A candidate 5 % faster than the default wins when the final round's halves agree; when
    they disagree by 12 % on the programs' relative times, 5 % is within the noise and the
    default keeps its place (as it would on a rerun with the noise the other way)."""
    default, candidate, *others = _ranked(2)
    half = iter(range(10**6))

    def seconds_of(config, final):
        if config == default:
            return 1.0
        if config == candidate:
            return 0.95
        # The others: 2.0 in the first half, 2.0 * (1 + disagree) in the second.
        return 2.0 * (1 + disagree * (final and next(half) % 2))

    _fake_measure(monkeypatch, seconds_of)
    result = tune(PROBLEM, TARGET, top_k=2)
    assert result.best == {"candidate": candidate, "default": default}[wins]
    # Twice the median of the halves' disagreements: 0 (the candidate) and the others'.
    assert result.tie_margin == pytest.approx(max(MARGIN, 1 - 1 / (1 + disagree)))


def test_final_round_survives_contenders_failing_there(monkeypatch):
    """A server that fails the final round (every contender's error instead of seconds)
    leaves the batch times standing and the noise unmeasured: the margin stays 2 %."""
    default, first, *_ = _ranked(2)
    _fake_measure(monkeypatch, lambda c, final: ("RemoteError: lost" if final
                                                 else {default: 1.0, first: 0.9}.get(c, 2.0)))
    result = tune(PROBLEM, TARGET, top_k=2)
    assert result.best == first and result.tie_margin == MARGIN


def test_final_round_takes_at_most_nine_contenders(monkeypatch):
    calls = []
    _fake_measure(monkeypatch, lambda c, final: 1.0, calls)
    tune(PROBLEM, TARGET, top_k=12)
    assert len(calls[-1]) == search._FINAL_CONTENDERS == 9
    assert calls[-1][0] == calls[0][0]  # the default, first


def test_no_final_round_for_the_default_alone(monkeypatch):
    calls = []
    _fake_measure(monkeypatch, lambda c, final: 1.0, calls)
    result = tune(PROBLEM, TARGET, top_k=0)
    assert len(calls) == 1 and result.best == DEFAULT and result.tie_margin == MARGIN


def test_incumbent_is_retimed_with_each_batch(monkeypatch):
    calls = []
    _fake_measure(monkeypatch, lambda c, final: 1.0, calls)
    result = tune(PROBLEM, TARGET, top_k=2 * search.BATCH)
    batches = calls[:-2]  # the last two calls are the final round's halves
    assert len(batches) >= 2 and batches[0][0] == result.best  # nothing beat the default...
    assert all(batch[-1] == result.best for batch in batches[1:])  # ...which ran in each batch


def test_incumbent_keeps_its_best_retiming_between_batches(monkeypatch):
    # Batch 1: the default (slow this time) and four slower candidates; batch 2: one more
    # candidate and the default again, faster now: the second batch's incumbent is timed at 1.0.
    default = _ranked(5)[0]
    batches = []
    retimed = iter([2.0, 1.0])
    _fake_measure(monkeypatch, lambda c, final: 1.0 if final and c == default else 3.0
                  if c != default else next(retimed), batches)
    result = tune(PROBLEM, TARGET, top_k=5)
    assert batches[1][-1] == default and result.best == default
    assert result.measurements[0].seconds == 1.0


def test_budget_stops_after_the_first_batch(monkeypatch):
    calls = []
    _fake_measure(monkeypatch, lambda c, final: 1.0, calls, delay=0.2)
    result = tune(PROBLEM, TARGET, top_k=3 * search.BATCH, budget_seconds=0.1)
    assert len(result.measurements) == 2  # the default and one candidate...
    assert calls == [calls[0]] * 3  # ...timed in one batch and in the final round's halves


def test_budget_shrinks_the_final_round(monkeypatch):
    timings = []

    def fake(problem, configs, target, isa, **options):
        time.sleep(0.05)
        timings.append(options.get("round_seconds"))
        return [1.0] * len(configs)

    monkeypatch.setattr(search, "measure", fake)
    tune(PROBLEM, TARGET, top_k=1, budget_seconds=0.06)  # nearly all spent on the batch
    assert timings[-1] < 0.01 * search._FINAL_SECONDS
    timings.clear()
    tune(PROBLEM, TARGET, top_k=1)
    assert timings[-1] == search._FINAL_SECONDS


def test_budget_admits_batches_that_fit(monkeypatch):
    calls = []
    _fake_measure(monkeypatch, lambda c, final: 1.0, calls, delay=0.05)
    result = tune(PROBLEM, TARGET, top_k=2 * search.BATCH, budget_seconds=60)
    # Batches of 2, BATCH and the rest of the 1 + top_k, each later one with the incumbent.
    rest = 1 + 2 * search.BATCH - 2 - search.BATCH
    assert [len(c) for c in calls] == [2, search.BATCH + 1, rest + 1,
                                       search._FINAL_CONTENDERS, search._FINAL_CONTENDERS]
    assert len(result.measurements) == 1 + 2 * search.BATCH


def test_build_reports_unbuildable_candidates():
    good = DEFAULT
    bad = GemmConfig.of("aBCa", good.bm, good.bn, good.bk)  # a parallel loop inside K's
    funcs = build(PROBLEM, [good, bad], TARGET, "avx2")
    assert callable(funcs[0]) and isinstance(funcs[1], str) and funcs[1]


def test_time_interleaved_runs_every_function_each_round():
    counts = [0, 0]

    def run(i):
        def f():
            counts[i] += 1
        return f

    seconds = time_interleaved([run(0), run(1)], rounds=2, round_seconds=0.0)
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)
    assert counts == [3, 3]  # a warm-up and one sample per round


def test_every_timed_run_follows_its_flush():
    log = []
    seconds = time_interleaved([lambda: log.append("run")], rounds=2, round_seconds=0.0,
                               before=[lambda: log.append("flush")])
    assert len(seconds) == 1 and log == ["flush", "run"] * 3


def test_flush_takes_the_operands_a_kernel_takes():
    """The flush is TVM's own: it runs on a kernel's operands (eviction itself is not observable
    here) and raises on an operand that is no tensor."""
    import numpy as np

    args = [tvm.runtime.tensor(np.ones(n, "float32")) for n in (4, 1 << 20, 8)]
    flush_operands(args)()
    with pytest.raises(Exception):  # noqa: B017 - TVM's FFI error type varies by build
        flush_operands([args[0], "not a tensor"])()


def test_keys_name_op_shape_and_layout():
    where = "avx2/haswell/1t"
    assert TuningKey.of(GemmProblem(48, 64, 96, epilogue=BIAS_RELU), TARGET).text() == \
        f"dense|48x64x96|float32|bias_relu|{where}"  # as before: old databases still hit
    strided = conv.ConvProblem(1, 3, 8, 8, 16, 3, 3, stride=2, padding=(1, 1, 0, 0))
    assert TuningKey.of(strided, TARGET).text() == \
        f"conv2d|1x3x8x8x16x3x3/s2x2p1x1x0x0|float32||{where}"
    heads = batch_gemm.BatchGemmProblem(4, 8, 8, 8, True, heads=2, x_interleaved=True)
    assert TuningKey.of(heads, TARGET).text() == f"batch_gemm|4x8x8x8/tx2|float32||{where}"
    with pytest.raises(TypeError, match="batch GEMM and attention"):
        TuningKey.of((48, 64, 96), TARGET)


@pytest.mark.parametrize("problem", [CONV, BATCH_GEMM], ids=["conv", "batch_gemm"])
def test_conv_and_batch_gemm_tune_persist_and_reuse(tmp_path, problem):
    """Measured from the template's list, default first; kept in the database; looked up."""
    path = tmp_path / "tuning.db"
    assert Tuner(Database(path)).config(problem, TARGET) is None
    result = tune(problem, TARGET, database=Database(path), top_k=2)
    default = config_for(problem, TARGET)
    template = conv if isinstance(problem, conv.ConvProblem) else batch_gemm
    listed = template.candidates(problem, machine_of(TARGET))
    assert [m.config for m in result.measurements] == listed[:3] and listed[0] == default
    assert not result.cached and result.best in listed[:3]
    assert all(m.seconds and m.model_rank is None for m in result.measurements)
    record = Database(path).record(TuningKey.of(problem, TARGET))
    assert record["gflops"] > 0 and record["candidates"] == len(listed)

    again = tune(problem, TARGET, database=Database(path))
    assert again.cached and again.tune_seconds == 0 and again.best == result.best
    lookup = Tuner(Database(path))
    assert lookup.config(problem, TARGET) == config_for(problem, TARGET, lookup) == result.best


def _conv_net() -> onnx.ModelProto:
    """An RGB stem (3 channels: its taps folded) and a 3x3 conv, each with bias and ReLU."""
    rng = np.random.default_rng(0)
    weights = {"w0": rng.standard_normal((16, 3, 3, 3)) / 5, "b0": rng.standard_normal(16),
               "w1": rng.standard_normal((16, 16, 3, 3)) / 12, "b1": rng.standard_normal(16)}
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["y"])]
    graph = helper.make_graph(
        nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 13, 13])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 7, 7])],
        [numpy_helper.from_array(v.astype("float32"), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.slow  # tunes every conv of a network; tune_cli_explains_convs is the short one
def test_compile_tunes_convs(tmp_path):
    """compile(tune=True) tunes each conv kernel, the tuned model matches ONNX Runtime, a
    rebuild from the work dir looks them up, and tuning again finds them in the database."""
    model, seen = _conv_net(), []
    tuned = tvm_tpp.compile(model, target=TARGET, tune=True, tune_budget=0.1,
                            work_dir=tmp_path, on_tuned=lambda p, r: seen.append((p, r)))
    inputs = random_inputs(tuned.inputs, seed=2)
    expected = run_onnxruntime(model, inputs)
    assert max_errors(tuned.run(**inputs), expected)[1] <= 1e-5
    keys = Database(tmp_path / "tuning.db").keys()
    assert [k.split("|")[:2] for k in keys] == [
        ["conv2d", "1x16x7x7x16x3x3/s1x1p1x1x1x1"],
        ["conv2d", "1x3x13x13x16x3x3/s2x2p1x1x1x1"]]  # the stem
    assert not any(r.cached for _, r in seen) and len(seen) == 2

    rebuilt = tvm_tpp.compile(model, target=TARGET, work_dir=tmp_path)
    assert max_errors(rebuilt.run(**inputs), expected)[1] <= 1e-5
    again = tvm_tpp.tune(model, target=TARGET, work_dir=tmp_path)
    assert [t.result.cached for t in again] == [True, True]


def test_tune_cli_explains_convs(tmp_path, capsys):
    from tvm_tpp.cli import main

    path = tmp_path / "convs.onnx"
    onnx.save(_conv_net(), str(path))
    args = ["tune", str(path), "--target", "tpp -num-cores=1", "--work-dir", str(tmp_path),
            "--budget", "0.1", "--explain"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "conv2d 1x16x7x7x16x3x3/s1x1p1x1x1x1 bias_relu -> " in out
    assert "no cost model ranks this operator: measured in its template's order" in out
    assert "measured best is model rank" not in out and "* = kept" in out
    assert main(args[:-1]) == 0 and "(database)" in capsys.readouterr().out


def test_long_k_choices_measure_packed_and_unpacked_blockings():
    problem = GemmProblem(40, 64, 1024)
    choices, _ = OPS["dense"].choices(problem, _machine(2, SMALL_L2), 60)
    default = choices[0].config
    assert default.pack_a == 1 and choices[0].rank is not None  # the long-K default, ranked
    configs = [c.config for c in choices]
    assert any(c.pack_a is None and c.k_step > 1 for c in configs)  # whole K per call
    assert any(c.pack_a is None and c.k_step == 1 for c in configs)
    packed = [c for c in configs if c.pack_a is not None]
    # Packed under the outermost K loop, and only where N blocks reuse the packed A.
    assert all(c.pack_a == c.spec.lower().index("a") + 1 for c in packed)
    assert all("c" in c.spec.lower()[c.pack_a:] for c in packed)
    assert len(set(configs)) == len(configs)
    # Every blocking's best loop order is measured before any blocking's second.
    firsts = {(c.config.bm, c.config.bn, c.config.bk, c.config.k_step, c.config.pack_a is None)
              for c in choices[1:4]}
    assert len(firsts) == 3 and [c.rank for c in choices[1:4]] == [0, 0, 0]


def test_database_keeps_packing(tmp_path):
    config = GemmConfig.of("aCB", 8, 32, 24, pack_a=1)
    key = TuningKey.of(PROBLEM, TARGET)
    Database(tmp_path / "t.db").put(key, config)
    assert Database(tmp_path / "t.db").get(key) == config
    assert config_text(config).endswith("pack_a=1")


def test_tied_predictions_share_a_model_rank():
    # One blocking here: 16 columns are one AVX2 register tile and the widest block.
    choices, _ = OPS["dense"].choices(GemmProblem(48, 16, 96), _machine(1), 60)
    ranked = sorted((c.cycles, c.rank) for c in choices)
    assert ranked[0][1] == 0
    for (c1, r1), (c2, r2) in zip(ranked, ranked[1:], strict=False):
        assert r1 == r2 if c1 == c2 else r1 < r2
    assert any(c1 == c2 for (c1, _), (c2, _) in zip(ranked, ranked[1:], strict=False))


def test_model_classes_merge_predictions_within_the_resolution():
    """Rank: candidates of the blocking predicted faster; class: faster by more than
    MODEL_RESOLUTION."""
    problem, machine = GemmProblem(256, 256, 1024), _machine(2)
    choices, _ = OPS["dense"].choices(problem, machine, 200)
    blockings = gemm.blockings(problem, machine)

    def kind(cfg):
        return cfg.bm, cfg.bn, cfg.bk, cfg.k_step, cfg.pack_a is None

    families = {kind(b): [x for x, _ in gemm.ranked_configs(problem, b, machine, 200)]
                for b in blockings}
    for c in choices:
        family = families[kind(c.config)]
        assert c.rank == sum(x < c.cycles for x in family)
        resolved = c.cycles * (1 - MODEL_RESOLUTION)
        assert c.model_class == sum(x < resolved for x in family)
    assert any(c.model_class < c.rank for c in choices)


def test_gemv_gets_no_packed_blocking():
    choices, _ = OPS["dense"].choices(GemmProblem(1, 64, 1024), _machine(1, SMALL_L2), 60)
    assert all(c.config.pack_a is None for c in choices)
