"""The training job: set up target, drafter replicas and threads, measure tau, train, measure again.

``train(config)`` is the whole job and can be driven from Python (benchmarks use it with tiny sizes);
``python -m dflash_train`` is a command line around it. ``Trainer`` holds the job's parts; its
``train_step`` is one replica's step, read top to bottom, and ``_run_threads`` the threads around the steps
(the workers themselves, the queues, the barrier, the watchdog and Ctrl-C are in ``workers``).
"""

from __future__ import annotations

import copy
import math
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

import torchfix  # noqa: F401  (makes torch's compile state thread-local: threads may compile concurrently)

from . import faults, run_dir, streams
from .batch import StepBatch, make_step_batch, to_device
from .checkpoint import load_checkpoint, save_checkpoint
from .config import ConfigError, Ranks, TrainConfig
from .data import TrainingData, eval_prompts
from .devices import cpu_thread_budget, cuda_offset, peak_memory, resolve_devices
from .distributed import Collectives
from .evaluate import acceptance_length, show_blocks
from .export import write_export
from .files import RunLock, remove_leftovers
from .flops import peak_flops, step_flops
from .model import Drafter, drafter_config, make_replicas
from .profiling import StepProfiler
from .report import MetricsLog, Progress, plot_metrics
from .target import Target, load_target, prepare_target, regenerate
from .workers import Job, StepSync, Turnstile, Watchdog, drafter_worker, stop_on_signals, target_worker


@dataclass(kw_only=True)
class TrainResult:
    steps_done: int  # optimizer steps done in total (including those before a resume)
    tau_before: float | None
    tau_after: float | None
    final_loss: float | None
    tokens_per_s: float | None  # context tokens through target and drafter, after the first (compiling) step
    mfu: float | None  # model FLOPs utilisation at that rate (see flops.py); None on CPUs and unknown GPUs
    wall_s: float
    interrupted: bool  # stopped by Ctrl-C or SIGTERM, on this rank or another (a checkpoint was saved)
    out_dir: Path
    drafters: list[Drafter]  # the trained replicas, identical: drafters[0] speaks for all
    first_step_s: dict[str, float]  # seconds from the job's start to each drafter thread's first step done
    dynamo: dict[str, object]  # what torch.compile did in this process (see dynamo_summary)
    compile_mode: str  # --compile-mode
    stop_signal: signal.Signals | None  # the signal that stopped it here (SIGINT, SIGTERM), if one did

    def summary(self) -> str:
        """The report of a job that ran to its end: steps, time, throughput and tau; each drafter thread's first
        step; what torch.compile compiled and whether anything fell back to eager (or skipped CUDA graphs)."""
        line = f"done: {self.steps_done} steps in {self.wall_s:.0f} s"
        if self.tokens_per_s:
            line += f", {self.tokens_per_s:,.0f} tokens/s"
        if self.mfu is not None:
            line += f" (MFU {self.mfu:.1%})"
        if self.tau_before is not None and self.tau_after is not None:
            line += f"; tau {self.tau_before:.2f} -> {self.tau_after:.2f}"
        lines = [f"{line}. Outputs in {self.out_dir}: config.toml, metrics.jsonl, plot.png, checkpoint.safetensors"]
        if self.first_step_s:
            firsts = ", ".join(f"{thread} {s:.1f} s" for thread, s in self.first_step_s.items())
            lines.append(f"first step done (from the job's start, compilation included): {firsts}")
        d = self.dynamo
        fallback = f"eager fallbacks: {d['graph_breaks']} graph breaks, {d['frames_failed']} frames not compiled"
        line = f"{d['unique_graphs']} graphs; {fallback if d['eager_fallback'] else 'no eager fallback'}"
        if self.compile_mode == "default":
            lines.append(f"torch.compile: {line}")
        else:
            if self.compile_mode == "reduce-overhead":
                skips = d["cudagraph_skips"]
                skipped = (
                    f"CUDA graphs skipped {skips} times (see the warnings above)" if skips else "no CUDA graph skipped"
                )
                line += f"; {skipped}"
            lines.append(f"torch.compile (mode {self.compile_mode}): {line}")
        return "\n".join(lines)


def lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    return lr_at


def frozen_heads(targets: list[Target], devices: set[torch.device]) -> dict[torch.device, tuple]:
    """The target's (embedding, LM head) on each drafter device: the target's own modules where a
    target lives on that device, else one copy per device shared by all replicas there."""
    heads = {}
    for device in devices:
        local = next((t for t in targets if t.device == device), None)
        if local is not None:
            heads[device] = (local.input_embeddings(), local.output_head())
        else:
            pair = copy.deepcopy((targets[0].input_embeddings(), targets[0].output_head()))  # keeps ties
            heads[device] = tuple(m.to(device) for m in pair)
    return heads


def compile_replica(replica: Drafter, device: torch.device, cfg: TrainConfig) -> None:
    """What runs compiled in a replica's training step. On the CPU: its layers, with --backend (dense mask
    and SDPA in the graph). On CUDA with --compile-mode default: flex attention and the block mask, compiled
    once for all threads where model.py and masks.py define them; the layers stay eager. On CUDA with
    another mode: the step's whole loss (every layer with flex attention and its checkpoint inside), by
    inductor in that mode."""
    if not cfg.compile:
        return
    if device.type == "cpu":
        replica.compile_training(cfg.backend)
    elif cfg.compile_mode != "default":
        replica.compile_training("inductor", mode=cfg.compile_mode)


def uses_cudagraphs(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether a replica on ``device`` trains with CUDA graphs (its compiled step loss)."""
    return cfg.compile and cfg.compile_mode == "reduce-overhead" and device.type == "cuda"


def train(config: TrainConfig) -> TrainResult:
    """The whole job. Under torchrun, every rank calls it; rank 0 alone writes outputs and reports."""
    trainer = Trainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.close()


class Trainer:
    """The parts of one rank's job: target threads' models, drafter replicas and their optimizers, the
    training data, metrics and the collectives to the other ranks.

    ``train_step`` is one replica's optimizer step and ``target_step`` one step's batch through a target;
    ``fit`` runs them in threads (see ``_run_threads``: queues, watchdog, Ctrl-C) between two evaluations."""

    def __init__(self, config: TrainConfig) -> None:
        self.started = time.monotonic()
        self.metrics: MetricsLog | None = None
        self.collectives: Collectives | None = None
        self.profiler: StepProfiler | None = None
        self.lock: RunLock | None = None
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: TrainConfig) -> None:
        cfg = self.cfg = config.resolved()
        ranks = self.ranks = Ranks.from_env()
        out = self.out = Path(cfg.out_dir)
        self.ckpt = out / run_dir.CHECKPOINT
        run_dir.check_paths(cfg, ranks)  # before anything slow (the command line checked them before torch, too)
        out.mkdir(parents=True, exist_ok=True)
        if ranks.is_main:  # the rank that writes there: one run at a time, then what a killed save left goes
            self.lock = RunLock(out)
            if leftovers := remove_leftovers(out):
                print(f"dflash-train: removed what an interrupted save left in {out}: {', '.join(leftovers)}")
            if cfg.resume:
                print(run_dir.resume_note(cfg), flush=True)
            run_dir.start_run(cfg)
        offset = cuda_offset(cfg, ranks)
        self.target_devices = resolve_devices(cfg.target_devices, "--target-devices", offset)
        self.drafter_devices = [
            d
            for d in resolve_devices(cfg.drafter_devices, "--drafter-devices", offset)
            for _ in range(cfg.drafter_threads_per_device)
        ]
        self.collectives = Collectives(
            ranks, self.drafter_devices[0], cfg.dist_timeout, gloo_only=cfg.ranks_share_devices
        )
        self.collectives.check_same(len(self.drafter_devices), "drafter threads")

        with self.collectives.local_main_first():  # one process per host fills the cache, the others read it
            path, self.tokenizer, corpus = prepare_target(cfg, self.target_devices[0])
            self.target_path = path
            self.targets = [load_target(path, d, cfg.drafter_layers) for d in self.target_devices]
            self.data = (
                regenerate(cfg, self.targets[0], path, corpus, self.tokenizer)
                if cfg.regenerate
                else TrainingData(corpus.train)
            )
        target = self.targets[0]
        dcfg = drafter_config(
            target.model.config, cfg.drafter_layers, cfg.block_size, target.tap_ids, self.tokenizer.mask_token_id
        )
        heads = frozen_heads(self.targets, set(self.drafter_devices))
        self.replicas = make_replicas(dcfg, heads, self.drafter_devices, cfg.seed)
        self.optimizers = [
            # Fused: one kernel for the whole update rather than one multi-tensor launch per moment and parameter list.
            torch.optim.AdamW(r.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=True)
            for r in self.replicas
        ]
        self.lr_at = lr_schedule(cfg)
        # Every rank reads the checkpoint itself (so several hosts need a shared --out-dir).
        self.start = load_checkpoint(self.ckpt, cfg, self.replicas, self.optimizers) if cfg.resume else 0
        for replica in self.replicas:  # the same seed made them equal; this makes sure of it, cheaply
            self.collectives.broadcast_(list(replica.parameters()))
        self.end = min(cfg.steps, self.start + cfg.stop_after) if cfg.stop_after else cfg.steps
        self.metrics = MetricsLog(
            out / run_dir.METRICS if ranks.is_main else None,
            resumed_at=self.start if cfg.resume else None,
            started=self.started,
            tensorboard=Path(cfg.tensorboard) if cfg.tensorboard else None,
        )
        self.flops_per_step = step_flops(
            target.model.config,
            dcfg,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            num_anchors=cfg.num_anchors,
            block_size=cfg.block_size,
        )
        # The job's GPUs: this rank's, on every host (ranks that share devices share them with the host's others).
        hosts_or_ranks = ranks.world_size // ranks.local_world_size if cfg.ranks_share_devices else ranks.world_size
        peak = peak_flops([*self.target_devices, *self.drafter_devices])
        self.peak_flops = peak * hosts_or_ranks if peak is not None else None
        window = cfg.profile_window()
        if window is not None and not self.start <= window[0] < window[1] <= self.end:
            raise ConfigError(
                f"--profile-steps {cfg.profile_steps}: this run trains steps {self.start + 1} to {self.end}"
            )
        if window is not None and ranks.is_main:
            cuda = any(d.type == "cuda" for d in [*self.target_devices, *self.drafter_devices])
            self.profiler = StepProfiler(window, out / "profile", cuda)
        texts = eval_prompts(corpus.held_out, cfg.eval_prompts, cfg.eval_prompt_len) if cfg.eval_prompts else []
        # Asked as the training samples were (in the chat template where the tokenizer has one).
        self.prompts = [torch.tensor(self.tokenizer.prompt(text.tolist())) for text in texts]
        # What the threads share, made before any of them starts: failures, stop requests and step reports (the
        # job), the replicas' barrier and gradient average (the sync).
        self.job = Job(self.started)
        self.sync = StepSync(self.replicas, self.job, self.collectives, cfg.grad_clip)

    def mfu(self, tokens_per_s: float | None) -> float | None:
        """The job's model FLOPs utilisation at ``tokens_per_s`` (see ``flops``); None without a known peak."""
        if tokens_per_s is None or self.peak_flops is None:
            return None
        steps_per_s = tokens_per_s / (self.cfg.batch_size * self.cfg.seq_len)
        return steps_per_s * self.flops_per_step / self.peak_flops

    def describe(self) -> str:
        cfg, target, ranks = self.cfg, self.targets[0], self.ranks
        return (
            f"target {cfg.target!r}: {target.model.config.num_hidden_layers} layers ({target.trunk_layers} run), "
            f"hidden {target.hidden_size}, tapped layers {target.tap_ids}; drafter: {cfg.drafter_layers} layers, "
            f"{sum(p.numel() for p in self.replicas[0].parameters()):,} trainable parameters, block {cfg.block_size}; "
            f"{len(self.replicas)} drafter threads on {cfg.drafter_devices}, {len(self.targets)} target thread(s) on "
            f"{cfg.target_devices}"
            + (f"; in each of {ranks.world_size} ranks" if ranks.world_size > 1 else "")
            + (f"; drafter step compiled with mode {cfg.compile_mode}" if cfg.compile_mode != "default" else "")
        )

    # --- one step ---------------------------------------------------------------------------------------

    def target_step(self, step: int, *, target: Target) -> list[StepBatch]:
        """This rank's shard of the step's batch (the job's global batch and loss normalisation are those of
        one process with all the job's replicas), with the target's hidden states: one shard per replica,
        on that replica's device."""
        cfg = self.cfg
        batch = make_step_batch(
            self.data,
            step,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            num_anchors=cfg.num_anchors,
            block_size=cfg.block_size,
            gamma=cfg.loss_gamma,
            seed=cfg.seed,
        ).split(self.ranks.world_size)[self.ranks.rank]
        batch.features = target.features(to_device(batch.input_ids, target.device))
        shards = batch.split(len(self.replicas))
        return [shard.to(device) for shard, device in zip(shards, self.drafter_devices)]

    def train_step(self, batch: StepBatch, *, index: int) -> None:
        """One optimizer step of replica ``index``; every replica takes its step at the same time.

        With CUDA graphs (--compile-mode reduce-overhead) the step begins with
        ``torch.compiler.cudagraph_mark_step_begin()``: the memory of the previous step's graph outputs may be
        reused from there. Nothing keeps such an output across steps: the loss and the accuracy are computed
        outside the graphs, and the gradients, graph outputs of the backward, are dropped at the end of the
        step. The mark is this thread's: torchfix makes it per thread (torch keeps one process-wide counter,
        which would start a new step in every other thread's CUDA graphs in the middle of theirs)."""
        replica, optimizer, device = self.replicas[index], self.optimizers[index], self.drafter_devices[index]
        if uses_cudagraphs(self.cfg, device):
            torch.compiler.cudagraph_mark_step_begin()
        flex = device.type == "cuda" and self.cfg.compile
        loss, correct = replica.training_loss(batch, flex=flex, chunk_blocks=self.cfg.loss_chunk)
        loss.backward()
        self.sync.wait(index, loss, correct, batch.supervised)  # the replicas' gradients averaged (all ranks)
        for group in optimizer.param_groups:
            group["lr"] = self.lr_at(batch.step)
        optimizer.step()
        # Dropped, not zeroed: with CUDA graphs the layers' gradients are graph outputs (see above).
        optimizer.zero_grad(set_to_none=True)

    def after_step(self, done: int, last: bool) -> None:
        """Replica 0's report of a step (rank 0 checkpoints), between its steps."""
        self.job.events.put({"type": "train", "step": done, "figures": self.sync.figures, "lr": self.lr_at(done - 1)})
        if self.ranks.is_main and (last or (self.cfg.save_every and done % self.cfg.save_every == 0)):
            save_checkpoint(self.ckpt, self.replicas[0], self.optimizers[0], done, self.cfg, self.target_path)

    # --- the job ----------------------------------------------------------------------------------------

    def evaluate(self, step: int, when: str) -> float | None:
        """tau (per prompt, as the reference benchmark computes it), on rank 0 only: the others wait without the
        step timeout, however long it takes (rather than evaluating too, which would compete with rank 0 for the
        cores of a shared host)."""
        if not self.prompts:
            return None
        tau = None
        if self.ranks.is_main:
            cfg = self.cfg
            found = acceptance_length(self.targets[0], self.replicas[0], self.prompts, cfg.eval_new_tokens)
            tau = found.per_prompt
            self.metrics.write("eval", step=step, tau=tau, tau_pooled=found.pooled, histogram=found.histogram)
            sample = show_blocks(found.generations[0], len(self.prompts[0]), self.tokenizer.decode)
            print(
                f"tau {when}: {tau:.2f} (mean tokens per target forward, per prompt; {found.pooled:.2f} pooled over "
                f"all steps; {len(self.prompts)} held-out prompts x {cfg.eval_new_tokens} tokens, block "
                f"{cfg.block_size}); blocks of the first: {sample!r}",
                flush=True,
            )
        self.collectives.wait_for_others()
        return tau

    def fit(self) -> TrainResult:
        """Evaluate, train steps [start, end) in threads, evaluate again; write the summary and the plot."""
        cfg, ranks, metrics, start = self.cfg, self.ranks, self.metrics, self.start
        if ranks.is_main:
            print(self.describe(), flush=True)
        tau_before = self.evaluate(start, "before training" if start == 0 else f"at step {start} (resumed)")
        for replica, device in zip(self.replicas, self.drafter_devices):
            compile_replica(replica, device, cfg)
            replica.train()
        if cfg.compile and cfg.compile_target:
            for target in self.targets:
                if target.device.type == "cuda":
                    target.compile_features()  # after the evaluation, which runs the whole model
        cpu_workers = sum(d.type == "cpu" for d in [*self.drafter_devices, *self.target_devices])
        with cpu_thread_budget(cpu_workers * ranks.local_world_size):
            run = self._run_threads()
        tau_after = (
            None if run.interrupted or run.steps_done == start else self.evaluate(run.steps_done, "after training")
        )
        dynamo = dynamo_summary()
        memory = peak_memory({*self.target_devices, *self.drafter_devices})
        # Every rank's first-step times, compile counters and peak memory go to rank 0's metrics.
        for rank, (times, counters, peaks) in enumerate(self.collectives.gather((run.first_step_s, dynamo, memory))):
            for thread, seconds in times.items():
                metrics.write("first_step", rank=rank, thread=thread, seconds=seconds)
            metrics.write("dynamo", rank=rank, **counters)
            metrics.write("memory", rank=rank, **peaks)
        metrics.write(
            "summary",
            steps_done=run.steps_done,
            tau_before=tau_before,
            tau_after=tau_after,
            final_loss=run.final_loss,
            tokens_per_s=run.tokens_per_s,
            mfu=self.mfu(run.tokens_per_s),
            interrupted=run.interrupted,
            compile_mode=cfg.compile_mode,
        )
        metrics.close()
        if ranks.is_main and run.steps_done > start:
            plot_metrics(self.out / run_dir.METRICS, self.out / run_dir.PLOT)
            if cfg.export:
                drafter = self.replicas[0]
                write_export(drafter.config, drafter.state_dict(), Path(cfg.export), target_path=self.target_path)
        return TrainResult(
            steps_done=run.steps_done,
            tau_before=tau_before,
            tau_after=tau_after,
            final_loss=run.final_loss,
            tokens_per_s=run.tokens_per_s,
            mfu=self.mfu(run.tokens_per_s),
            wall_s=time.monotonic() - self.started,
            interrupted=run.interrupted,
            out_dir=self.out,
            drafters=self.replicas,
            first_step_s=run.first_step_s,
            dynamo=dynamo,
            compile_mode=cfg.compile_mode,
            stop_signal=run.stop_signal,
        )

    def close(self) -> None:
        """Close the metrics file, a profile left open, the process group and the out-dir lock, whether the job
        finished or failed."""
        if self.profiler is not None:
            self.profiler.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.collectives is not None:
            self.collectives.close()
        if self.lock is not None:
            self.lock.release()

    # --- the threads around the steps -------------------------------------------------------------------

    def _run_threads(self) -> _Run:
        """Steps [start, end): one thread per target and per replica, joined by bounded queues (target to
        replica) and the replicas' barrier; the main thread reports progress until they finish, under the
        watchdog and the handler of Ctrl-C and SIGTERM."""
        cfg, start, end = self.cfg, self.start, self.end
        if start >= end:
            return _Run(steps_done=start, final_loss=None, tokens_per_s=None, interrupted=False)
        job = self.job
        inboxes: list[queue.Queue] = [queue.Queue(maxsize=cfg.queue_size) for _ in self.replicas]
        turnstile = Turnstile(start)
        per_thread = cfg.cuda_streams == "per-thread"
        # A fault a test armed (faults.py) hits the last rank, one failing rank being the interesting case: the
        # target thread of its step, or the last drafter thread.
        hit_here = self.ranks.is_last
        for i, target in enumerate(self.targets):
            work = partial(
                target_worker,
                job=job,
                work=faults.injected("target", partial(self.target_step, target=target), here=hit_here),
                steps=range(start + i, end, len(self.targets)),
                turnstile=turnstile,
                queues=inboxes,
            )
            job.start(f"target-{i} ({target.device})", streams.on_own_stream(target.device, per_thread, work))
        last = len(self.replicas) - 1
        for index, device in enumerate(self.drafter_devices):
            work = partial(
                drafter_worker,
                job=job,
                train_step=faults.injected(
                    "drafter", partial(self.train_step, index=index), here=hit_here and index == last
                ),
                inbox=inboxes[index],
                sync=self.sync,
                steps=range(start, end),
                after_step=self.after_step if index == 0 else None,
            )
            job.start(f"drafter-{index} ({device})", streams.on_own_stream(device, per_thread, work))
        with Watchdog(job, cfg.watchdog_timeout), stop_on_signals(job):
            try:
                run = self._follow(job, inboxes)
            finally:
                job.close()  # releases the target workers (and everyone else, after a failure or a second Ctrl-C)
            deadline = time.monotonic() + 30  # a thread busy compiling leaves at its next step boundary
            for thread in job.threads:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if job.failure is not None:
            raise job.failure
        streams.synchronize([*self.target_devices, *self.drafter_devices])  # the workers' streams, for what follows
        return run

    def _follow(self, job: Job, inboxes: list[queue.Queue]) -> _Run:
        """The main thread while the workers train: step reports to the metrics and the progress bar."""
        cfg, start, end = self.cfg, self.start, self.end
        tokens_per_step = cfg.batch_size * cfg.seq_len  # the job's, all ranks together
        drafters = [t for t in job.threads if t.name.startswith("drafter")]
        done, loss, first_report, rate = start, None, None, None
        first_step_s: dict[str, float] = {}
        announced_stop = False
        show = Progress(
            "drafter", end, initial=start, bar=cfg.progress, every=cfg.log_every, quiet=not self.ranks.is_main
        )
        with show:
            if cfg.compile:
                show.note("compiling the first step (torch.compile, in each drafter thread)")
            while job.failure is None:
                if job.stop_requested.is_set() and not announced_stop:
                    name = "Ctrl-C" if job.stop_signal == signal.SIGINT else job.stop_signal.name
                    show.write(f"{name}: finishing this step and saving a checkpoint ({name} again to quit at once)")
                    announced_stop = True
                try:
                    event = job.events.get(timeout=0.2)
                except queue.Empty:
                    if not any(t.is_alive() for t in drafters):
                        break  # all reports are in: replica 0 posts before it leaves
                    continue
                if event.pop("type") == "first_step":
                    first_step_s[event["thread"]] = event["seconds"]
                    continue
                event.update(event.pop("figures").read())  # waits for the GPU to reach the step's end
                now = time.monotonic()
                done, loss = event["step"], event["loss"]
                if self.profiler is not None:  # the step has reached its end on the GPU too (read above)
                    self.profiler.at_step(done)
                # Throughput from the second report on: the first step includes compilation.
                depth = sum(q.qsize() for q in inboxes)
                if first_report is not None and now > first_report:
                    rate = (done - start - 1) * tokens_per_step / (now - first_report)
                self.metrics.write("train", **event, tokens_per_s=rate, mfu=self.mfu(rate), queue_depth=depth)
                figures = {"loss": f"{loss:.3f}", "acc": f"{event['acc']:.2f}"}
                if rate is not None:
                    figures["tokens/s"] = f"{rate:,.0f}"
                show.update(done, figures | {"queue": str(depth)})
                if first_report is None:
                    first_report = now
                    show.restart_clock()
        # Stopped early: by Ctrl-C or SIGTERM, here or on another rank (the stop decision is the job's).
        return _Run(
            steps_done=done,
            final_loss=loss,
            tokens_per_s=rate,
            interrupted=done < end,
            first_step_s=first_step_s,
            stop_signal=job.stop_signal,
        )


def dynamo_summary() -> dict[str, object]:
    """Whether torch.compile ran everything it was given compiled (issues 4 and 7): graphs compiled,
    graph breaks (part of a function ran eagerly) and frames that failed to compile (all of it ran
    eagerly), from Dynamo's process-wide counters (the same keys in torch 2.0 - 2.15); and how often
    inductor compiled a graph without the CUDA graphs its mode asked for (issue 11: 0 unless
    --compile-mode reduce-overhead; the key exists from torch 2.6)."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    failed = counters["frames"]["total"] - counters["frames"]["ok"]
    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(breaks.values()),
        "frames_failed": failed,
        "eager_fallback": bool(breaks) or failed > 0,
        "graph_break_reasons": sorted(breaks)[:5],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


@dataclass(kw_only=True)
class _Run:
    steps_done: int
    final_loss: float | None
    tokens_per_s: float | None
    interrupted: bool
    first_step_s: dict[str, float] = field(default_factory=dict)
    stop_signal: signal.Signals | None = None
