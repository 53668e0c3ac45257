"""Trainer and its hooks: when they run, what they print, checkpoints and resuming."""

import io
import logging
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.loop import CheckpointHook, EvalHook, Hook, LoggingHook, Trainer, hooks, replica_means
from replicator.training.checkpoint import CheckpointError, CheckpointManager, save_checkpoint

ROWS = 16  # rows per worker batch
TRUE_W = np.array([1.0, -2.0, 0.5], np.float32)
_opt = optax.sgd(0.1, momentum=0.9)


def make_input(num_batches=None):
    """An input_fn whose batch i depends only on (i, worker): runs can be compared bit for bit."""

    def input_fn(ctx):
        i = 0
        while num_batches is None or i < num_batches:
            rng = np.random.default_rng([i, ctx.worker_id])
            x = rng.normal(size=(ROWS, 3)).astype(np.float32)
            yield {"x": x, "y": x @ TRUE_W}
            i += 1

    return input_fn


def step_fn(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2))(params)
    updates, opt_state = _opt.update(rp.all_mean(grads), opt_state, params)
    # "loss" is the local loss of each replica: the hooks average it over replicas.
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss, "rows": jnp.float32(batch["x"].shape[0])}


def init_state():
    params = {"w": jnp.zeros(3)}
    return params, _opt.init(params)


def eval_fn(state, batch):
    return {"mean_x": jnp.mean(batch["x"]), "vector": jnp.zeros(2)}


def eval_input(num_batches=3):
    def input_fn(ctx):
        for i in range(num_batches):
            yield {"x": np.full((ctx.cores_per_worker,), float(i), np.float32)}

    return input_fn


class Recorder(Hook):
    def __init__(self):
        self.calls = []

    def before_run(self, trainer):
        self.calls.append(("before_run", trainer.step))

    def after_step(self, trainer):
        self.calls.append(("after_step", trainer.step))

    def after_run(self, trainer):
        self.calls.append(("after_run", trainer.step))


class TTY(io.StringIO):
    def isatty(self):
        return True


class TestHooks:
    def test_called_at_the_right_steps(self, repl, capsys, tmp_path):
        recorder = Recorder()

        class OnlyAfterStep:  # duck typing: methods it lacks are skipped
            steps = []

            def after_step(self, trainer):
                self.steps.append(trainer.step)

        duck = OnlyAfterStep()
        log, ev = LoggingHook(every=3), EvalHook(eval_fn, eval_input(), every=4, num_batches=1)
        save = CheckpointHook(tmp_path, every=5, keep=None)
        trainer = Trainer(repl, step_fn, make_input(), init_state(), hooks=[recorder, duck, log, ev, save])
        trainer.run(10)
        assert recorder.calls == [("before_run", 0), *(("after_step", s) for s in range(1, 11)), ("after_run", 10)]
        assert duck.steps == list(range(1, 11))
        assert [r["step"] for r in log.history] == [3, 6, 9, 10]  # and the last step
        assert [r["step"] for r in ev.history] == [4, 8, 10]
        assert save.saved == [5, 10] and CheckpointManager(tmp_path).all_steps() == [5, 10]

        trainer.run(12)  # a second run continues
        assert recorder.calls[-4:] == [("before_run", 10), ("after_step", 11), ("after_step", 12), ("after_run", 12)]
        assert [r["step"] for r in log.history][-1] == 12 and save.saved == [5, 10, 12]
        trainer.run(12)  # nothing to do: no step, no extra log or save
        assert recorder.calls[-2:] == [("before_run", 12), ("after_run", 12)]
        assert len(log.history) == 5 and save.saved == [5, 10, 12]
        capsys.readouterr()

    def test_should_stop(self, repl):
        class StopAt(Hook):
            def after_step(self, trainer):
                trainer.should_stop = trainer.step == 3

        recorder, log = Recorder(), LoggingHook(every=100, progress=False)
        trainer = Trainer(
            repl, step_fn, make_input(), init_state(), hooks=[StopAt(), recorder, log], stream=io.StringIO()
        )
        trainer.run(10)
        assert trainer.step == 3 and recorder.calls[-1] == ("after_run", 3)
        assert [r["step"] for r in log.history] == [3]

    def test_input_exhausted_stops_the_run(self, repl, capsys):
        recorder = Recorder()
        trainer = Trainer(repl, step_fn, make_input(num_batches=4), init_state(), hooks=[recorder])
        trainer.run(10)
        assert trainer.step == 4 and recorder.calls[-1] == ("after_run", 4)
        assert capsys.readouterr().out == "input_fn exhausted after 4 batches: stopping at step 4\n"

    def test_input_fn_fed_by_steps_stops_the_run(self, repl, capsys):
        """A generator input_fn that runs steps itself: their InputExhausted is not turned into RuntimeError."""
        raw = make_input(num_batches=3)

        def preprocessed(ctx):  # batches made by a step over another input_fn
            while True:
                out = repl.run(lambda b: {"x": 2 * b["x"], "y": 2 * b["y"]}, raw)
                yield {k: np.asarray(v).reshape(ROWS, *np.shape(v)[2:]) for k, v in out.items()}

        trainer = Trainer(repl, step_fn, preprocessed, init_state())
        trainer.run(10)
        assert trainer.step == 3
        assert capsys.readouterr().out == "input_fn exhausted after 3 batches: stopping at step 3\n"

    def test_input_context_names_one_pipeline_per_worker(self, repl2d):
        contexts = []

        def input_fn(ctx):
            contexts.append(ctx)
            return make_input()(ctx)

        Trainer(repl2d, step_fn, input_fn, init_state()).run(1)
        assert sorted(c.worker_id for c in contexts) == list(range(repl2d.num_workers))
        for ctx in contexts:
            assert ctx.num_input_pipelines == ctx.num_workers == repl2d.num_workers
            assert ctx.input_pipeline_id == ctx.worker_id

    def test_eval_averages_over_replicas_and_batches_and_compiles_once(self, repl):
        ev = EvalHook(eval_fn, eval_input(3), every=2)
        ev2 = EvalHook(eval_fn, eval_input(3), every=2, num_batches=2, name="val")
        trainer = Trainer(repl, step_fn, make_input(), init_state(), hooks=[ev, ev2], stream=io.StringIO())
        trainer.run(2)
        traces = repl.trace_count
        trainer.run(6)
        assert repl.trace_count == traces  # every evaluation reuses the compiled step
        assert [h["batches"] for h in ev.history] == [3, 3, 3]  # each evaluation starts the input over
        assert all(h["metrics"] == {"mean_x": 1.0} for h in ev.history)  # (0 + 1 + 2) / 3; vector is left out
        assert all(h["metrics"] == {"mean_x": 0.5} for h in ev2.history)
        lines = trainer.console.stream.getvalue().splitlines()
        assert lines[:2] == ["eval step 2  mean_x 1  (3 batches)", "val step 2  mean_x 0.5  (2 batches)"]

    def test_eval_keeps_a_donated_state_valid(self, n_devices):
        repl = rp.Replicator(1, n_devices, donate_state=True)
        ev = EvalHook(eval_fn, eval_input(2), every=1)
        trainer = Trainer(repl, step_fn, make_input(), init_state(), hooks=[ev], stream=io.StringIO())
        state = trainer.run(2)
        assert np.all(np.isfinite(np.asarray(state[0]["w"])))

    def test_bad_arguments(self, repl):
        with pytest.raises(TypeError, match="Trainer trains a state"):
            Trainer(repl, step_fn, make_input(), None)
        with pytest.raises(TypeError, match="has none of the methods before_run, after_step, after_run"):
            Trainer(repl, step_fn, make_input(), init_state(), hooks=[object()])
        with pytest.raises(TypeError, match="input_fn must be a callable"):
            Trainer(repl, step_fn, [1, 2], init_state())
        with pytest.raises(ValueError, match="every= must be a positive int"):
            LoggingHook(every=0)
        with pytest.raises(ValueError, match="num_steps must be a non-negative int"):
            Trainer(repl, step_fn, make_input(), init_state()).run(-1)


class TestLogging:
    LINE = re.compile(r"^step (\d+)/(\d+)  loss (\S+)  rows (\S+)  (\d+\.\d) ms/step  (\d+) samples/s$")
    COMPILED = re.compile(
        r"^step 1: compiled in \d+\.\d\d s \(tracing, compiling and running the first step; not in ms/step\)$"
    )

    def test_plain_lines_when_not_a_tty(self, repl2d, capsys):
        log = LoggingHook(every=2)
        trainer = Trainer(repl2d, step_fn, make_input(), init_state(), hooks=[log])
        trainer.run(5)
        out = capsys.readouterr().out
        assert "\r" not in out and "[" not in out  # no progress bar
        lines = out.splitlines()
        if log.compiles:  # step_fn is compiled on repl2d by the first test that runs it
            assert self.COMPILED.match(lines.pop(0)), out
        assert len(lines) == 3 and all(self.LINE.match(line) for line in lines), out
        assert [self.LINE.match(line).group(1, 2) for line in lines] == [("2", "5"), ("4", "5"), ("5", "5")]

        # The numbers: replica means of the last outputs, rows from the batches.
        record = log.history[-1]
        assert record["metrics"]["loss"] == pytest.approx(float(np.mean(trainer.outputs["loss"])))
        per_replica_rows = ROWS // repl2d.cores_per_worker
        assert record["metrics"]["rows"] == per_replica_rows
        assert trainer.rows_per_step == ROWS * repl2d.num_workers and trainer.samples == 5 * trainer.rows_per_step
        assert record["samples_per_sec"] * record["step_time"] == pytest.approx(trainer.rows_per_step)
        assert float(self.LINE.match(lines[-1]).group(3)) == pytest.approx(record["metrics"]["loss"], rel=1e-3)

    def test_to_a_logger(self, repl, capsys, caplog):
        logger = logging.getLogger("test_loop")
        trainer = Trainer(repl, step_fn, make_input(), init_state(), hooks=[LoggingHook(every=2)], logger=logger)
        with caplog.at_level(logging.INFO, logger="test_loop"):
            trainer.run(4)
        assert capsys.readouterr().out == ""
        said = [r.getMessage().split("  ")[0] for r in caplog.records]
        assert [s for s in said if "compiled in" not in s] == ["step 2/4", "step 4/4"]

    def test_progress_bar_on_a_tty(self, repl):
        stream = TTY()
        trainer = Trainer(repl, step_fn, make_input(), init_state(), hooks=[LoggingHook(every=3)], stream=stream)
        trainer.run(4)
        out = stream.getvalue()
        assert out.endswith("\n") and "\r[" in out
        final_bar = out.rstrip("\n").split("\r")[-1]
        assert re.match(r"^\[#{30}\] 4/4 100%  \d+\.\d steps/s  eta 0s  loss \S+  rows \S+ *$", final_bar), final_bar
        # Log lines are printed above the bar, whole.
        visible = [part.strip() for line in out.split("\n") for part in line.split("\r")]
        assert any(re.match(r"^step 3/4  loss .* samples/s$", v) for v in visible)
        assert any(re.match(r"^step 4/4  loss .* samples/s$", v) for v in visible)

    @staticmethod
    def clocked(monkeypatch, seconds_per_step):
        """A hook that advances the LoggingHook's clock by ``seconds_per_step(step)`` after each step."""
        now = [0.0]
        monkeypatch.setattr(hooks, "time", SimpleNamespace(perf_counter=lambda: now[0]))

        class Clock(Hook):
            def after_step(self, trainer):
                now[0] += seconds_per_step(trainer.step)

        return Clock()

    def test_the_compiling_step_is_left_out_and_said(self, repl, monkeypatch):
        """The first step of a process traces and compiles (10 s here); the others take 10 ms: 10.0 ms/step."""
        clock = self.clocked(monkeypatch, lambda step: 10.0 if step == 1 else 0.01)
        log = LoggingHook(every=4, progress=False)
        fresh = lambda state, batch: step_fn(state, batch)  # noqa: E731 - not compiled by another test
        stream = io.StringIO()
        trainer = Trainer(repl, fresh, make_input(), init_state(), hooks=[clock, log], stream=stream)
        trainer.run(4)
        lines = stream.getvalue().splitlines()
        assert lines[0] == "step 1: compiled in 10.00 s (tracing, compiling and running the first step; not in ms/step)"
        assert log.compiles == [(1, 10.0)]
        assert self.LINE.match(lines[1]) and lines[1].endswith(" 10.0 ms/step  1600 samples/s"), lines
        assert log.history[0]["step_time"] == pytest.approx(0.01)

        trainer.run(8)  # compiled already: its first step is an ordinary one, and counted
        assert log.compiles == [(1, 10.0)] and len(stream.getvalue().splitlines()) == 3
        assert log.history[1]["step"] == 8 and log.history[1]["step_time"] == pytest.approx(0.01)

    def test_a_line_of_only_the_compiling_step_has_no_time(self, repl, monkeypatch):
        clock = self.clocked(monkeypatch, lambda step: 10.0 if step == 1 else 0.01)
        log = LoggingHook(every=1, progress=False)
        fresh = lambda state, batch: step_fn(state, batch)  # noqa: E731
        stream = io.StringIO()
        Trainer(repl, fresh, make_input(), init_state(), hooks=[clock, log], stream=stream).run(2)
        lines = stream.getvalue().splitlines()
        assert self.COMPILED.match(lines[0]) and re.fullmatch(r"step 1/2  loss \S+  rows \S+", lines[1]), lines
        assert log.history[0]["step_time"] is None and log.history[1]["step_time"] == pytest.approx(0.01)

    def test_replica_means_names(self):
        outputs = {
            "loss": np.array([1.0, 3.0]),
            "m": {"acc": np.array([0, 1])},
            "v": np.ones((2, 4)),
            "t": (np.ones(2),),
        }
        assert replica_means(outputs) == {"loss": 2.0, "m/acc": 0.5, "t/0": 1.0}
        assert replica_means(np.array([2.0, 4.0])) == {"output": 3.0}


class TestResume:
    def _reference(self, repl, total):
        trainer = Trainer(repl, step_fn, make_input(), init_state(), hooks=[])
        return trainer.run(total)

    def test_crash_and_resume_is_bit_identical(self, repl2d, tmp_path, capsys):
        total = 7
        reference = self._reference(repl2d, total)

        class Crash(Hook):
            def after_step(self, trainer):
                if trainer.step == 5:
                    raise KeyboardInterrupt("killed")

        first = Trainer(
            repl2d, step_fn, make_input(), init_state(), hooks=[CheckpointHook(tmp_path, every=2, keep=2), Crash()]
        )
        with pytest.raises(KeyboardInterrupt):
            first.run(total)
        assert CheckpointManager(tmp_path).all_steps() == [2, 4] and first.step == 5  # step 5 was lost

        fresh = rp.Replicator(repl2d.num_workers, repl2d.cores_per_worker)
        seen = []

        def input_fn(ctx):
            for i, batch in enumerate(make_input()(ctx)):
                seen.append(i)
                yield batch

        second = Trainer(
            fresh,
            step_fn,
            input_fn,
            init_state(),
            hooks=[CheckpointHook(tmp_path, every=2, keep=2)],
            resume_from=tmp_path,
        )
        assert second.step == 4 and second.restored_step == 4 and second.input_position == 4
        state = second.run(total)
        assert second.step == total and second.input_position == total
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert sorted(set(seen)) == list(range(total))  # batches 0-3 drawn and skipped, 4-6 trained on
        assert CheckpointManager(tmp_path).all_steps() == [6, 7]
        extra = CheckpointManager(tmp_path).restore(init_state())[2]
        assert extra == {
            "input_position": 7,
            "num_workers": repl2d.num_workers,
            "num_replicas": repl2d.num_replicas,
            "rows_per_step": second.rows_per_step,
        }
        assert "resumed from" in capsys.readouterr().out

    def test_resume_after_a_finished_run_does_nothing(self, repl, tmp_path, capsys):
        Trainer(repl, step_fn, make_input(), init_state(), hooks=[CheckpointHook(tmp_path, every=10)]).run(3)
        recorder, save = Recorder(), CheckpointHook(tmp_path, every=10)
        again = Trainer(repl, step_fn, make_input(), init_state(), hooks=[recorder, save], resume_from=tmp_path)
        again.run(3)
        assert again.step == 3 and recorder.calls == [("before_run", 3), ("after_run", 3)] and save.saved == []
        capsys.readouterr()

    def test_no_checkpoint_starts_from_scratch(self, repl, tmp_path, capsys):
        trainer = Trainer(repl, step_fn, make_input(), init_state(), resume_from=tmp_path / "new")
        assert trainer.step == 0 and trainer.restored_step is None
        assert capsys.readouterr().out == f"no checkpoint in {tmp_path / 'new'}: starting from step 0\n"

    def test_checkpoint_of_another_model(self, repl, tmp_path):
        save_checkpoint(tmp_path, 2, {"w": jnp.zeros(5)}, extra={"input_position": 2})
        with pytest.raises(CheckpointError, match=r"model expects state\[0\]\['w'\], which the checkpoint lacks"):
            Trainer(repl, step_fn, make_input(), init_state(), resume_from=tmp_path)

    def test_checkpoint_without_input_position(self, repl, tmp_path):
        save_checkpoint(tmp_path, 2, init_state())
        with pytest.raises(CheckpointError, match="has no input position.*not written by a Trainer"):
            Trainer(repl, step_fn, make_input(), init_state(), resume_from=tmp_path)

    def test_other_number_of_workers_without_its_global_batch(self, repl, tmp_path):
        save_checkpoint(tmp_path, 2, init_state(), extra={"input_position": 2, "num_workers": 3})
        with pytest.raises(
            CheckpointError,
            match=rf"trained with 3 worker\(s\) and this Replicator has {repl.num_workers}, and it does not say",
        ):
            Trainer(repl, step_fn, make_input(), init_state(), resume_from=tmp_path)

    def test_input_shorter_than_the_position(self, repl, tmp_path, capsys):
        save_checkpoint(tmp_path, 5, init_state(), extra={"input_position": 5})
        trainer = Trainer(repl, step_fn, make_input(num_batches=3), init_state(), resume_from=tmp_path)
        with pytest.raises(CheckpointError, match="ended after 3 batches, while skipping to input position 5"):
            trainer.run(6)
        capsys.readouterr()


def global_input(global_rows, num_batches=None):
    """Worker ``ctx.worker_id``'s share of global batch i (rows drawn from i alone), for ``ctx.num_workers``."""

    def input_fn(ctx):
        share = global_rows // ctx.num_workers
        i = 0
        while num_batches is None or i < num_batches:
            x = np.random.default_rng(i).normal(size=(global_rows, 3)).astype(np.float32)
            x = x[ctx.worker_id * share : (ctx.worker_id + 1) * share]
            yield {"x": x, "y": x @ TRUE_W}
            i += 1

    return input_fn


class TestResumeOnOtherWorkers:
    """A checkpoint of 4 workers resumed on 2 (``--min-workers``), on the same devices emulated in one process."""

    def _train_on_four(self, n_devices, tmp_path, input_fn, steps):
        four = rp.Replicator(num_workers=4, cores_per_worker=n_devices // 4)
        trainer = Trainer(four, step_fn, input_fn, init_state(), hooks=[CheckpointHook(tmp_path, every=steps)])
        trainer.run(steps)
        return trainer

    def test_the_global_batch_is_kept(self, n_devices, tmp_path, capsys):
        rows, first, total = 4 * n_devices, 3, 7
        self._train_on_four(n_devices, tmp_path, global_input(rows), first)
        two = rp.Replicator(num_workers=2, cores_per_worker=n_devices // 4)
        resumed = Trainer(two, step_fn, global_input(rows), init_state(), resume_from=tmp_path)
        assert (resumed.step, resumed.input_position) == (first, first)
        state = resumed.run(total)
        out = capsys.readouterr().out
        assert (
            f"resuming on 2 worker(s) x {n_devices // 4} cores from the checkpoint of step {first} in {tmp_path}, "
            f"trained on 4 worker(s) ({n_devices} replicas); keep_batch='global': the global batch of {rows} rows "
            f"is kept, 4 -> 8 rows per replica"
        ) in out, out
        assert resumed.rows_per_step == rows and "warning" not in out

        # Independent reference: plain jax.jit on one device, on each whole global batch.
        def loss(p, batch):
            return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

        @jax.jit
        def one_device_step(state, batch):
            params, opt_state = state
            updates, opt_state = _opt.update(jax.grad(loss)(params, batch), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        ref = init_state()
        whole = global_input(rows)(rp.InputContext(1, 0, 1))
        for _ in range(total):
            ref = one_device_step(ref, next(whole))
        # Tolerance: float32 rounding of means over 4 rows per replica then over replicas, vs one mean of all
        # rows; measured 6e-8 on 8 CPU devices.
        np.testing.assert_allclose(np.asarray(state[0]["w"]), np.asarray(ref[0]["w"]), rtol=0, atol=1e-5)

    def test_the_per_replica_batch_is_kept_on_request(self, n_devices, tmp_path, capsys):
        self._train_on_four(n_devices, tmp_path, make_input(), 2)
        two = rp.Replicator(num_workers=2, cores_per_worker=n_devices // 4)
        resumed = Trainer(two, step_fn, make_input(), init_state(), resume_from=tmp_path, keep_batch="per-replica")
        resumed.run(3)
        out = capsys.readouterr().out
        per_replica = ROWS // (n_devices // 4)
        assert (
            f"keep_batch='per-replica': {per_replica} rows per replica, so the global batch goes from {4 * ROWS} "
            f"to {2 * ROWS} rows per step. Warning: a learning rate tuned for {4 * ROWS} rows may need scaling"
        ) in out, out
        assert resumed.rows_per_step == 2 * ROWS and "warning: the first step" not in out

    def test_an_input_fn_of_fixed_rows_per_worker_is_warned_about(self, n_devices, tmp_path, capsys):
        self._train_on_four(n_devices, tmp_path, make_input(), 2)
        two = rp.Replicator(num_workers=2, cores_per_worker=n_devices // 4)
        Trainer(two, step_fn, make_input(), init_state(), resume_from=tmp_path).run(3)
        out = capsys.readouterr().out
        assert (
            f"warning: the first step resumed on 2 worker(s) trained on {2 * ROWS} rows, and "
            f"keep_batch='global' expects {4 * ROWS}: input_fn(ctx) yields the same rows per worker"
        ) in out, out

    def test_a_global_batch_the_replicas_cannot_share_is_refused(self, repl, tmp_path):
        extra = {"input_position": 2, "num_workers": 3, "num_replicas": 3, "rows_per_step": 3 * repl.num_replicas + 3}
        save_checkpoint(tmp_path, 2, init_state(), extra=extra)
        with pytest.raises(CheckpointError, match=r"which the \d+ replicas of 1 worker\(s\) x \d+ cores cannot share"):
            Trainer(repl, step_fn, make_input(), init_state(), resume_from=tmp_path)

    def test_bad_keep_batch(self, repl):
        with pytest.raises(ValueError, match="keep_batch must be 'global' .* or 'per-replica'"):
            Trainer(repl, step_fn, make_input(), init_state(), keep_batch="local")
