"""`sparecycles bench ...`: every benchmark's command (typer + stdlib at import; the work is imported inside).

kernels: probe kernels on a GPU (probe_kernels.bench, beside the kernels it measures); intake: result intake through
Redis (benchmarks.intake); fleet: probe throughput of real CPU workers (benchmarks.fleet); zo: the ZO
side-by-side benchmarks (benchmarks.zo); headline: the H200 headline report and memory scan (benchmarks.headline).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from probe_kernels import cli as kernels_cli

bench_app = typer.Typer(help="Benchmarks (kernels, probe, intake, fleet, zo, headline).", no_args_is_help=True)


def bench_intake(
    workers: int = typer.Option(64, min=1, help="Simulated workers (concurrent connections/threads)."),
    results: int = typer.Option(50_000, min=1, help="Probe results to submit in total."),
    batch: int = typer.Option(4, min=1, max=1024, help="Results per request (a task's seeds)."),
    mode: str = typer.Option("both", help="http, store or both."),
    rate: float = typer.Option(
        0.0, min=0.0, help="Open-loop offered load in results/s (http); 0 = closed loop."
    ),
    redis_url: str = typer.Option(
        os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), help="Redis to use (keys are namespaced)."
    ),
    coordinators: int = typer.Option(
        1, min=1, max=64, help="Coordinator processes in http mode (sparecycles coordinator --workers)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per mode."),
) -> None:
    """Results accepted per second end to end through Redis, and p50/p99 latency from publish to acceptance."""
    from benchmarks.intake import result_dict, run_intake_bench

    if mode not in ("http", "store", "both"):
        raise typer.BadParameter("mode must be http, store or both")
    for m in ["http", "store"] if mode == "both" else [mode]:
        res = run_intake_bench(m, workers, results, batch, redis_url, rate, coordinators=coordinators)
        if json_out:
            typer.echo(json.dumps(result_dict(res)))
        else:
            typer.echo(
                f"{res.mode:5s} {'rate=' + format(res.rate, '.0f') + ' ' if res.rate else ''}"
                f"{'coordinators=' + str(res.coordinators) + ' ' if res.coordinators > 1 else ''}"
                f"workers={res.workers} batch={res.batch} results={res.results} accepted={res.accepted} "
                f"streamed={res.streamed}  {res.results_per_s:,.0f} results/s  p50={res.p50_ms:.2f} ms  "
                f"p99={res.p99_ms:.2f} ms  ({res.seconds:.2f} s, {os.cpu_count()} CPUs, load {res.load_avg_1m})"
            )
            per = 1e3 / max(res.accepted, 1)
            coord, rds, cli = res.server_cpu_s * per, res.redis_cpu_s * per, res.client_cpu_s * per
            # One coordinator process is one core (GIL); Redis is another. Load-independent capacity:
            capacity = 1e3 / max(coord, rds, 1e-9)
            typer.echo(
                f"      CPU ms/result: coordinator {coord:.3f}, redis {rds:.3f}, simulated workers {cli:.3f} "
                f"-> one coordinator process on a dedicated core (+ Redis on another): ~{capacity:,.0f} results/s"
            )


def bench_fleet(
    workers: Annotated[str, typer.Option(help="Comma-separated worker counts to measure")] = "1,2,4",
    preset: Annotated[str, typer.Option(help="Model preset probed")] = "gpt2-tiny",
    seeds: Annotated[int, typer.Option(min=1, help="Seeds in the timed round")] = 32,
    seeds_per_task: Annotated[int, typer.Option(min=1, max=256, help="Seeds per Celery task")] = 4,
    batch_size: Annotated[int, typer.Option(min=1)] = 4,
    seq_len: Annotated[int, typer.Option(min=2)] = 64,
    threads: Annotated[int, typer.Option(min=1, help="torch threads per worker process")] = 1,
    ready_preset: Annotated[str, typer.Option(help="Preset whose publish -> ready latency is measured "
                                              "('' to skip)")] = "gpt2-small",
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL", help="Redis (keys are namespaced)")]
    = "redis://127.0.0.1:6379/0",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    device: Annotated[str, typer.Option(help="Workers' devices, round-robin: cpu, cuda:0 or cuda:1,cuda:2")] = "cpu",
    trainer_device: Annotated[str, typer.Option(help="Where the published model lives (cpu or cuda:N): on a GPU, "
                                                "synchronous and background publishes and the training loop's "
                                                "cost per version are measured")] = "cpu",
    compare_seeds: Annotated[int, typer.Option(min=0, help="Compare this many seeds of the timed round with "
                                               "in-process evaluation on the first worker's device")] = 0,
    interval: Annotated[int, typer.Option(min=2, help="Training steps per refresh interval (trainer cost)")] = 20,
    train_batch_size: Annotated[int, typer.Option(min=0, help="Trainer batch (trainer cost; default: batch-size)")] = 0,
    train_seq_len: Annotated[int, typer.Option(min=0, help="Trainer sequence length (default: seq-len)")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json-out", help="Also write the JSON here, after each phase")] = None,
    blob_path: Annotated[str, typer.Option(help="How weight shards reach the workers: shared (one blob directory "
                                           "on this host, as under `up`) or http (loopback HTTP, as to other "
                                           "hosts)")] = "shared",
    kind: Annotated[str, typer.Option(help="Timed rounds: seeded (probe rounds, fp32/TF32 on a GPU) or eval "
                                      "(held-out batches, one forward each: bf16 compiled on a GPU)")] = "seeded",
    worker_cuda_graphs: Annotated[bool, typer.Option(help="Workers replay their compiled forwards as CUDA "
                                                     "graphs (sparecycles worker --cuda-graphs)")] = False,
    tf32_attention: Annotated[str, typer.Option(help="Workers' attention in fp32/TF32 forwards: auto, fp32 or "
                                                "bf16 (sparecycles worker --tf32-attention)")] = "auto",
) -> None:
    """Probes per second with 1, 2, 4 workers (CPU or GPU), and version publish -> every worker ready latency."""
    from benchmarks.fleet import result_dict, run_fleet_bench

    try:
        counts = tuple(int(x) for x in workers.split(","))
    except ValueError:
        raise typer.BadParameter("use comma-separated integers, e.g. 1,2,4", param_hint="--workers") from None
    from fleet.devices import place_here

    if blob_path not in ("shared", "http"):
        raise typer.BadParameter("use shared or http", param_hint="--blob-path")
    if kind not in ("seeded", "eval"):
        raise typer.BadParameter("use seeded or eval", param_hint="--kind")
    if tf32_attention not in ("auto", "fp32", "bf16"):
        raise typer.BadParameter("use auto, fp32 or bf16", param_hint="--tf32-attention")
    wargs = ("--cuda-graphs",) * worker_cuda_graphs + ("--tf32-attention", tf32_attention)
    try:
        devs = place_here(worker_devices=device).workers
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None
    if trainer_device != "cpu":
        try:
            trainer_device = place_here(device=trainer_device).trainer
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--trainer-device") from None

    def save(r) -> None:
        if json_path is not None:
            json_path.write_text(json.dumps(result_dict(r), indent=1))

    res = run_fleet_bench(redis_url, counts, preset, seeds, seeds_per_task, (batch_size, seq_len), threads,
                          ready_preset, devs, trainer_device, compare_seeds, interval,
                          (train_batch_size or batch_size, train_seq_len or seq_len), save, blob_path, kind, wargs)
    save(res)
    if json_out:
        typer.echo(json.dumps(result_dict(res)))
        return
    typer.echo(f"{preset}, {kind} rounds, batch {batch_size}x{seq_len}, {seeds} seeds in tasks of {seeds_per_task}, "
               f"{threads} thread(s)/worker, {os.cpu_count()} CPUs")
    for n, rate in res.probes_per_s.items():
        typer.echo(f"  {n} worker(s): {rate:8.2f} results/s ({res.forward_passes_per_s[n]:.2f} forward passes/s, "
                   f"{res.tokens_per_s[n] / 1e6:.3f}M tokens/s)")
    if res.ready_preset:
        typer.echo(f"  publish -> every worker ready, {res.ready_preset} ({res.ready_bytes / 2**20:.0f} MiB): "
                   f"{res.publish_to_ready_s:.2f} s (publish itself {res.publish_s:.2f} s; shards by {res.blob_path})")


def bench_zo(
    part: str = typer.Option("all", help="lm (gpt2-tiny: AdamW vs ZO-Curv), sentiment (MeZO/1SPSA/1.5-SPSA) or all."),
    out: Path = typer.Option(Path("runs/zo-bench"), help="Folder for JSON summaries, PNG figures and run folders."),
    device: str = typer.Option("cpu", help="cpu or cuda[:N]."),
    steps: int = typer.Option(600, min=1, help="lm: optimizer steps per run."),
    probes: int = typer.Option(32, min=1, help="lm: block-scaled probes per curvature round."),
    k: int = typer.Option(16, min=1, help="sentiment: probes K per step of 1SPSA and 1.5-SPSA."),
    budget: int = typer.Option(6000, min=3, help="sentiment: forward passes per run."),
    lrs: str = typer.Option("1e-5,1e-4,1e-3", help="sentiment: comma-separated learning rates tried per method."),
    seed: int = typer.Option(0, min=0, help="Run seed."),
    methods: str = typer.Option("mezo,1spsa,1.5spsa", help="sentiment: comma-separated ZO methods to sweep."),
    model: str = typer.Option("minilm", help="sentiment: minilm (MiniLM-L6 + new head) or smollm2 "
                              "(SmolLM2-135M-Instruct as a prompt + label-word classifier, all parameters)."),
    head_init: str | None = typer.Option(None, help="sentiment: classifier start; minilm: random (BERT init, default) or "
                                  "linear-probe (logistic regression on frozen features first: LP-FT); smollm2: "
                                  "prompt (the zero-shot prompt classifier, its only start)."),
    evals: int = typer.Option(10, min=1, help="sentiment: accuracy evaluations per run."),
    backprop_steps: int = typer.Option(0, min=0, help="sentiment: also run the backprop AdamW baseline this many steps."),
    backprop_lr: float | None = typer.Option(None, min=0.0, help="sentiment: AdamW lr of the baseline (default 5e-5 minilm, "
                                      "1e-5 smollm2)."),
    regime: str = typer.Option("project", help="sentiment: project (the sweep above) or paper (smollm2 only: 1.5-SPSA's "
                               "published regime, arms A1..A6 of issue 18; benchmarks.zo_paper)."),
    arms: str = typer.Option("", help="regime paper: comma-separated arms (A1,A2,A3,A3w,A4-16,A4-128,A5-1e-05,"
                             "A5-3e-05,A6-1e-05,A6-5e-05); empty = all. The time budget is shared by these only."),
    time_budget: float = typer.Option(300.0, min=1.0, help="regime paper: seconds shared by the arms run now (each "
                                      "stops at its share or its iteration cap)."),
    fp32_matmul: str = typer.Option("highest", help="regime paper, CUDA: fp32 arms' matmuls, highest (true fp32) or "
                                    "high (TF32: ~2x faster, but its rounding swamps h at eps 1e-4); per arm: "
                                    "e.g. high,A1=highest,A3=highest (a bare mode is the default)."),
    include: Annotated[Path | None, typer.Option(help="regime paper: an earlier call's paper_summary.json to merge: "
                       "its arms are kept unless re-run; its A1 gives A3w's lr and the drift's ledger.")] = None,
    resume: bool = typer.Option(False, help="regime paper: an arm named in --arms that stopped on time in the "
                                "--include summary continues from its last iteration (its step ledger replayed) "
                                "instead of restarting; one that finished there is kept."),
    shares: str = typer.Option("", help="regime paper: share weights overriding the defaults (A1 24, A2 16, A3 11, "
                               "A3w 11, A4-16 5, A4-128 8, A5-* 5, A6-* 3), e.g. A1=70,A3=24; renormalised."),
    drift: bool = typer.Option(True, help="regime paper: measure the bf16 in-place drift on A1's ledger (once per "
                               "ledger, after the arms; ~10 s on a GPU at 75 iterations)."),
    iters_cap: int | None = typer.Option(None, min=1, help="regime paper: cap every arm's iterations (smoke tests)."),
    end_by: float | None = typer.Option(None, help="regime paper: wall-clock deadline (unix seconds, e.g. "
                                        "$(( $(date +%s) + 540 ))): the arms' budget shrinks so the run ends by then."),
) -> None:
    """Run the ZO benchmarks on real data and write lm_summary.json / sentiment_summary.json and PNGs."""
    from benchmarks.zo import lm_comparison, sentiment_comparison

    if part not in ("lm", "sentiment", "all"):
        raise typer.BadParameter(f"part must be lm, sentiment or all, got {part!r}")
    if regime not in ("project", "paper"):
        raise typer.BadParameter(f"project or paper, got {regime!r}", param_hint="--regime")
    if regime == "paper":
        _bench_zo_paper(model, out, device, arms, time_budget, seed, fp32_matmul, include, drift, iters_cap,
                        resume, shares, end_by)
        return
    # Every option is checked before anything runs: with --part all the lm part takes minutes first.
    ms, head_init, grid = _check_zo_project(part, out, device, methods, model, head_init, lrs, budget, k)
    if part in ("lm", "all"):
        s = lm_comparison(out, steps=steps, device=device, probes=probes, seed=seed)
        typer.echo(json.dumps({k: {"final_val_loss": v["final_val_loss"], "steps_to_adamw_final":
                                   v["steps_to_adamw_final"]} for k, v in s["runs"].items()}))
    if part in ("sentiment", "all"):
        s = sentiment_comparison(out, budget=budget, device=device, probes=k, lrs=grid, seed=seed, methods=ms,
                                 head_init=head_init, evals=evals, backprop_steps=backprop_steps, model=model,
                                 backprop_lr=backprop_lr)
        typer.echo(json.dumps({m: {k2: v for k2, v in b.items() if k2 != "curve"} for m, b in s["best"].items()}))
        if "1.5spsa_vs_mezo" in s:
            typer.echo(json.dumps({"1.5spsa_vs_mezo": s["1.5spsa_vs_mezo"]}))


def _check_zo_project(part: str, out: Path, device: str, methods: str, model: str, head_init: str | None, lrs: str,
                      budget: int, k: int) -> tuple[tuple[str, ...], str | None, tuple[float, ...]]:
    """`bench zo --regime project`'s options checked before anything runs; returns (methods, the resolved
    head init, the lr grid). Raises typer.BadParameter naming the option at fault."""
    from benchmarks.zo import check_sentiment_folder, forwards_per_step, resolve_head_init
    from trainer.methods import method_names

    ms = tuple(m.strip() for m in methods.split(",") if m.strip())
    pure_zo = method_names(kind="pure-zo", task="sentiment")
    bad = [m for m in ms if m not in pure_zo]
    if bad or not ms:
        raise typer.BadParameter(f"methods are {', '.join(pure_zo)}; got {methods!r}", param_hint="--methods")
    if model not in ("minilm", "smollm2"):
        raise typer.BadParameter(f"minilm or smollm2, got {model!r}", param_hint="--model")
    try:
        head_init = resolve_head_init(model, head_init)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--head-init") from None
    try:  # empty is allowed: tools/h200_headline.sh merges earlier runs' JSON with --lrs ""
        grid = tuple(float(x) for x in lrs.split(",") if x.strip())
    except ValueError:
        grid = (float("nan"),)
    if not all(0 < lr < 1 for lr in grid):
        raise typer.BadParameter(f"comma-separated learning rates in (0, 1), got {lrs!r}", param_hint="--lrs")
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise typer.BadParameter(f"cpu or cuda[:N], got {device!r}", param_hint="--device") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise typer.BadParameter(f"{device!r} is not available here (CUDA available: "
                                 f"{torch.cuda.is_available()})", param_hint="--device")
    if part in ("sentiment", "all") and grid:
        # forward passes per step: 2 per probe (+1 clean for 1.5-SPSA); a smaller budget would run no step
        need = {m: forwards_per_step(m, k) for m in ms}
        short = {m: n for m, n in need.items() if budget < n}
        if short:
            raise typer.BadParameter(f"{budget} forward passes is less than one step of {short} (forwards per "
                                     f"step with --k {k}); raise --budget", param_hint="--budget")
    if part in ("sentiment", "all"):
        try:
            check_sentiment_folder(out, model)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--out") from None
    return ms, head_init, grid


def _bench_zo_paper(model: str, out: Path, device: str, arms: str, time_budget: float, seed: int,
                    fp32_matmul: str, include: Path | None, drift: bool, iters_cap: int | None, resume: bool,
                    shares: str, end_by: float | None) -> None:
    """`bench zo --regime paper`: validate, run benchmarks.zo_paper.paper_main, print the arms' table."""
    from benchmarks.zo_paper import paper_main
    from benchmarks.zo_paper_plan import check_plan, paper_arms, parse_matmul, parse_weights

    if model != "smollm2":
        raise typer.BadParameter(f"--regime paper runs on smollm2 only, got {model!r}", param_hint="--model")
    names = tuple(a.strip() for a in arms.split(",") if a.strip()) or None
    try:
        weights = parse_weights(shares)
        paper_arms(time_budget, weights=weights)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--shares") from None
    try:
        plan = [a["name"] for a in paper_arms(time_budget, names)]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--arms") from None
    if resume and include is None:
        raise typer.BadParameter("--resume continues arms of an --include summary: give --include", param_hint="--resume")
    inc = None
    if include is not None:
        try:
            inc = json.loads(include.read_text())
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"cannot read {include}: {e}", param_hint="--include") from None
    try:
        check_plan(plan, inc)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--arms") from None
    try:
        matmul = parse_matmul(fp32_matmul, plan)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--fp32-matmul") from None
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter(f"{device!r} is not available here", param_hint="--device")
    s = paper_main(out, device=device, total_s=time_budget, arms=names, seed=seed, fp32_matmul=matmul,
                   include=include, resume=resume, weights=weights or None, drift=drift, iters_cap=iters_cap,
                   end_by=end_by)
    for row in s["table"]:
        typer.echo(json.dumps(row))
    if "drift" in s:
        typer.echo(json.dumps({"drift": s["drift"]}))


headline_app = typer.Typer(help="Headline benchmarks: pretraining report, memory scan (tools/h200_headline.sh "
                                "runs the whole set on a GPU machine).", no_args_is_help=True)


@headline_app.command("report")
def report(
    runs: Annotated[list[Path], typer.Argument(help="finished `sparecycles train` run folders (one AdamW at least)")],
    out: Annotated[Path, typer.Option(help="folder for pretrain_summary.json and pretrain_val_loss.png")] = Path(
        "runs/headline"),
) -> None:
    """Validation loss at equal steps, and steps / wall time to reach each AdamW reference's final loss."""
    from benchmarks.headline import pretrain_report

    missing = [str(r) for r in runs if not (r / "metrics.jsonl").is_file()]
    if missing:
        raise typer.BadParameter(f"not run folders (no metrics.jsonl): {', '.join(missing)}")
    try:
        res = pretrain_report(runs, out)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    for name, r in res["runs"].items():
        same = r.get("same_lr_adamw", {})
        typer.echo(f"{name}: final val {r['final_val_loss']:.4f}; reaches best AdamW final at step "
                   f"{r['best_adamw']['step_reached']} (ratio {r['best_adamw']['step_ratio']}); same-lr AdamW "
                   f"final at step {same.get('step_reached')} (ratio {same.get('step_ratio')})")
    typer.echo(f"wrote {out / 'pretrain_summary.json'} and {out / 'pretrain_val_loss.png'}")


@headline_app.command("memory")
def memory(
    device: Annotated[str, typer.Option(help="CUDA device")] = "cuda",
    shapes: Annotated[str, typer.Option(help="comma-separated shapes, ascending (benchmarks.headline.SCAN_SHAPES)")] = (
        "gpt2-xl,gpt-2.7b,gpt-6.7b,gpt-13b,gpt-30b,gpt-45b"),
    seq_len: Annotated[int, typer.Option(min=1, max=1024, help="tokens per sequence (batch 1)")] = 1024,
    json_out: Annotated[Path | None, typer.Option(help="write the scan as JSON here")] = None,
) -> None:
    """Largest GPT shape that takes a training step in place with AdamW vs 1.5-SPSA on one GPU; peak memory."""
    from benchmarks.headline import memory_scan

    try:
        res = memory_scan(device, tuple(s.strip() for s in shapes.split(",") if s.strip()), seq_len=seq_len)
    except (ValueError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    for t in res["trials"]:
        typer.echo(f"{t['method']:8s} {t['shape']:9s} {t['params'] / 1e9:6.2f}B params  "
                   f"{'ok ' if t['ok'] else 'OOM'} peak {t['peak_bytes'] / 2**30:7.1f} GiB")
    typer.echo(f"largest: {res['largest']} on {res['gpu']} ({res['gpu_bytes'] / 2**30:.0f} GiB)")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2))


def bench_regime(ctx: typer.Context) -> None:
    """Issue 29's comparison (benchmarks.regime): `run --plan full|h200|cpu --out DIR [--jobs J --devices
    cuda:0,cuda:1 --deadline-s S --batch-size B --seq-len T --corpus C]` runs the resumable plan, `report DIR`
    writes regime_summary.json, regime.png and regime_tables.md."""
    from benchmarks.regime import main

    main(list(ctx.args))


def bench_data_pack(
    size_mb: float = typer.Option(100.0, min=0.1, help="Size of the text folder to pack, in MB (10^6 bytes)."),
    model: str = typer.Option("gpt2-tiny", help="Model preset or transformers folder whose tokenizer packs it."),
    workdir: Path | None = typer.Option(None, help="Where the temporary folder and cache go (default: $TMPDIR)."),
    out: Path = typer.Option(Path("benchmarks/results/cpu/data_pack.json"), help="Result JSON to write."),
) -> None:
    """Tokenization throughput (tokens/s, 1 thread and every core) and the time to pack a folder of real text
    with --data (cold, then a cache hit), written to OUT (benchmarks.data_pack)."""
    from benchmarks.data_pack import run

    res = run(size_mb, model, workdir, out)
    tp, cold = res["tokenize_throughput"], res["pack_cold"]
    for k, v in tp.items():
        if k.startswith("threads_"):
            typer.echo(f"tokenize {k.replace('_', ' ')}: {v['tokens_per_s']:,} tokens/s ({v['tokens']:,} tokens)")
    typer.echo(f"pack {res['folder']['bytes'] / 1e6:.1f} MB in {res['folder']['files']} files: {cold['total_s']:.1f} s "
               f"cold ({cold['tokens']:,} tokens; tokenize {cold['tokenize_s']:.1f} s), "
               f"{res['pack_warm_cache_hit']['total_s']:.1f} s cache hit; load {res['machine']['load_avg_1m_before']} "
               f"-> {res['machine']['load_avg_1m_after']} on {res['machine']['cpus']} CPUs; wrote {out}")


def bench_precision(
    preset: Annotated[str, typer.Option(help="Model preset")] = "gpt2-small",
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    seq_len: Annotated[int, typer.Option(min=2)] = 512,
    steps: Annotated[int, typer.Option(min=21, help="AdamW steps on real text before measuring")] = 60,
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per perturbing kind and batch")] = 8,
    batches: Annotated[int, typer.Option(min=1, help="Validation batches scored")] = 2,
    corpus: Annotated[str, typer.Option(help="Corpus (train split trains, validation split is scored)")] = "classics-small",
    device: Annotated[str, typer.Option(help="Torch device (cuda:N; cpu runs every column eagerly)")] = "cuda:0",
    json_path: Annotated[Path | None, typer.Option("--json-out", help="Write the result JSON here")] = None,
) -> None:
    """Per round kind, the signal-to-noise of TF32 and bf16 forwards against fp32 (benchmarks.precision)."""
    from benchmarks.precision import measure, precisions, table

    res = measure(preset, (batch_size, seq_len), steps, seeds, batches, corpus, device,
                  progress=lambda m: typer.echo(m, err=True))
    res["measured_precision"] = precisions(res)
    if json_path is not None:
        json_path.write_text(json.dumps(res, indent=1))
    typer.echo(table(res))
    typer.echo(f"bound: bf16 SNR >= {res['snr_bound']:g}; from this measurement: {res['measured_precision']}")


def bench_serving(
    requests: Annotated[int, typer.Option(min=2, help="Requests per arm")] = 20,
    rate: Annotated[float, typer.Option(min=0.01, max=100.0, help="Poisson arrivals per second")] = 0.2,
    hold: Annotated[float, typer.Option(min=0.0, help="The yielding worker's --serving-hold (seconds)")] = 0.5,
    control_interval: Annotated[float, typer.Option(min=0.05, help="The workers' control interval (seconds)")] = 0.2,
    seed: Annotated[int, typer.Option(help="Seed of the arrivals and of the text passages")] = 0,
    blocks: Annotated[int, typer.Option(min=1, help="Interleave the arms in this many blocks (a, b, c, a, b, c, ...)")]
    = 4,
    probes: Annotated[int, typer.Option(min=1, max=4096, help="The trainer's probes per step (1SPSA K)")] = 64,
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL", help="Redis (keys are namespaced)")]
    = "redis://127.0.0.1:6379/0",
    out: Annotated[Path, typer.Option(help="Folder for serving.json and serving.png")]
    = Path("benchmarks/results/cpu/serving"),
) -> None:
    """Serving latency beside a fleet worker: (a) engine alone, (b) busy worker, (c) engine-aware yielding."""
    from benchmarks.serving import run_serving_bench

    if len(os.sched_getaffinity(0)) < 2:
        raise typer.BadParameter("needs 2 CPUs (the engine and worker on one, trainer and load on the other)")
    res = run_serving_bench(redis_url, requests, rate, hold, control_interval, seed, out, blocks, probes,
                            progress=lambda m: typer.echo(m, err=True))
    for arm, f in res["arms"].items():
        typer.echo(f"({arm}) TTFT p50/p95/p99 {f['ttft_s']['p50']:.3f}/{f['ttft_s']['p95']:.3f}/"
                   f"{f['ttft_s']['p99']:.3f} s  e2e {f['e2e_s']['p50']:.3f}/{f['e2e_s']['p95']:.3f}/"
                   f"{f['e2e_s']['p99']:.3f} s  {f['output_tokens_per_s']:.2f} tokens/s  forwards "
                   f"{f['probe_forwards_done']:.0f}  idle used {f['idle_used_share'] or 0:.2f}  reclaim p95 "
                   f"{f['reclaim_s']['p95'] if f['reclaim_s']['p95'] is not None else float('nan'):.3f} s")
    for arm, r in res.get("ratios", {}).items():
        typer.echo(f"({arm}) / (a) p95: TTFT {r['ttft_s']:.3f}x, e2e {r['e2e_s']:.3f}x")
    typer.echo(f"wrote {out / 'serving.json'} and {out / 'serving.png'}")


def bench_serving_load(
    url: Annotated[str, typer.Argument(help="The engine's base URL (OpenAI-compatible), e.g. http://127.0.0.1:8100")],
    requests: Annotated[int, typer.Option(min=1, help="Requests to send")] = 40,
    rate: Annotated[float, typer.Option(min=0.01, max=100.0, help="Poisson arrivals per second")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed of the arrivals and of the text passages")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json-out", help="Write every request's timings here")] = None,
) -> None:
    """The open-loop request load alone (Poisson arrivals, lengths from a real text) against a running engine: the
    CPU load of tools/serving_demo.sh. Prints TTFT and end-to-end p50/p95/p99."""
    import httpx

    from benchmarks.serving_load import CONTEXT, make_requests, outcome_dict, percentiles, run_load, verses

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    outs = run_load(url, model, make_requests(requests, rate, seed, verses(requests * CONTEXT + 1)))
    ok = [o for o in outs if not o.error and o.end is not None]
    ttft = percentiles([o.ttft_s for o in ok if o.ttft_s is not None])
    e2e = percentiles([o.e2e_s for o in ok])
    if json_path is not None:
        json_path.write_text(json.dumps({"ttft_s": ttft, "e2e_s": e2e, "requests": [outcome_dict(o) for o in outs]},
                                        indent=1))
    typer.echo(f"{len(ok)}/{len(outs)} answered; TTFT p50/p95/p99 {ttft}; end to end {e2e}")


# short_help: the one-line summaries `sparecycles bench --help` lists, whole at 80 columns.
bench_app.command("kernels", short_help="Fused perturb/replay kernels vs copy bandwidth.")(
    kernels_cli.bench_kernels)
bench_app.command("probe", short_help="One probe worker's speed on one GPU.")(kernels_cli.bench_probe)
bench_app.command("intake", short_help="Coordinator intake: results/s and latency.")(bench_intake)
bench_app.command("fleet", short_help="Fleet probes/s with 1, 2, 4 workers; publish time.")(bench_fleet)
bench_app.command("data-pack", short_help="Tokens/s and the time to pack a 100 MB --data folder.")(
    bench_data_pack)
bench_app.command("precision", short_help="bf16 vs TF32 signal-to-noise per round kind.")(bench_precision)
bench_app.command("zo", short_help="ZO-Curv and pure-ZO benchmarks on real data.")(bench_zo)
bench_app.command("serving", short_help="Serving latency beside a worker, with and without yielding.")(
    bench_serving)
bench_app.command("serving-load", short_help="Open-loop requests against a running engine.")(bench_serving_load)
bench_app.command("regime", short_help="Block-type lrs vs AdamW at large batch (issue 29).",
                  context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                    "help_option_names": []})(bench_regime)
bench_app.add_typer(headline_app, name="headline",
                    short_help="Headline benchmarks: pretraining report, memory scan.")

if __name__ == "__main__":
    bench_app()
