"""GPU smoke test of the in-process verl glue: a few real verl PPO steps under ``watchdog run``.

Needs a machine with a CUDA GPU, verl, vLLM and a small instruct model on local disk
(Qwen2.5-0.5B-Instruct style; ``--model`` takes a directory or a Hugging Face id already
in the local cache). It

1. writes the synthetic arithmetic task (:mod:`ppo_watchdog.trainer.data`) as GSM8K-style parquet
   (``data_source=openai/gsm8k``, so verl's own GSM8K scorer rewards it);
2. runs ``watchdog run --rules bench/verl_gpu_smoke.yaml -- python -m ppo_watchdog.trainer.verl_glue ...``:
   verl's sync PPO (GAE, critic, KL in the reward with a fixed controller, vLLM rollout) for
   ``--steps`` steps, checkpoints every 3; the smoke rule pack makes the watchdog write two
   live changes to control.json: ``algorithm.kl_ctrl.kl_coef`` x2 from step 2 and the actor
   lr x0.5 from step 3;
3. checks the run directory (:func:`check_run`): ``started``, one ``applied`` event per
   change, the logged ``actor/reward_kl_penalty_coeff`` and ``actor/lr`` equal to the old
   values before and the new ones after the applied step, ``checkpoint`` events and
   ``finished``.

``--check-only RUN_DIR`` runs step 3 alone (on CPU too). Exit code 0 when every check
passes; the checks are printed and written to ``RUN_DIR/smoke.json``. See bench/README.md.

Zero-patch mode (``--mode zero-patch``, and first under the default ``--mode both``): the
same tiny model under an *unmodified* ``python3 -m verl.trainer.main_ppo`` watched by
``watchdog run --mode verl`` with bench/verl_gpu_smoke_zero_patch.yaml, ``save_freq=2``,
8 steps, and bench/smoke_inject on PYTHONPATH (a sitecustomize that makes verl's actor
update raise one CUDA OOM in the third launch). :func:`check_zero_patch` then checks:
verl's file logger reached the run directory; a checkpoint was judged complete; the lr
change by relaunch resumed from a patched copy that loads with ``weights_only=True``,
``actor/lr`` is the new value after the resume, the step count continued, and the
watchdog's peak memory during the patch stayed within its bound plus slack; the
``clip_ratio`` relaunch moved ``actor/pg_clipfrac``; the injected OOM was classified
(cuda, actor_update), remedied with a micro batch verl accepted (the next launch trained),
and the GPU was free (``nvidia-smi``, sampled every 0.5 s) between the OOM and the
relaunch; every relaunch's cost (stop to first new step) was measured. One prepared run:
about 4-6 minutes on one H200 with the tiny model, then the in-process checks.
``--check-zero-patch RUN_DIR`` runs those checks alone (on CPU too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ppo_watchdog.protocol import rundir  # noqa: E402
from ppo_watchdog.protocol.runinfo import RunInfo  # noqa: E402

KL_KEY = "algorithm.kl_ctrl.kl_coef"
LR_KEY = "actor_rollout_ref.actor.optim.lr"
KL_METRIC = "actor/reward_kl_penalty_coeff"
LR_METRIC = "actor/lr"
KL0, LR0 = 0.001, 1e-6  # the launch values; the smoke rules double kl_coef and halve the lr
SUFFIX = ' Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k prompt


@dataclass
class Check:
    """One verdict about the run directory."""

    name: str
    ok: bool
    detail: str


# -- the checks (pure file reading: runs anywhere) -------------------------------------------


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for rec in rundir.read_jsonl(run_dir / rundir.METRICS).records:
        out.setdefault(int(rec["step"]), {}).update(rec.get("data") or {})
    return out


def _applied(events: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The first ``applied`` event whose version changed ``key``."""
    for e in events:
        if e.get("kind") == "applied" and key in (e.get("applied") or {}):
            return e
    return None


def _follows(metrics: dict[int, dict[str, float]], metric: str, at: int, old: float, new: float) -> Check:
    """``metric`` equals ``old`` on steps up to ``at`` and ``new`` after it (rel. 1e-6)."""
    before = [(s, m[metric]) for s, m in sorted(metrics.items()) if s <= at and metric in m and s > 0]
    after = [(s, m[metric]) for s, m in sorted(metrics.items()) if s > at and metric in m]

    def near(x: float, y: float) -> bool:
        return math.isclose(x, y, rel_tol=1e-6)

    ok = bool(after) and all(near(v, old) for _, v in before) and all(near(v, new) for _, v in after)
    return Check(f"{metric} follows the change at step {at}", ok,
                 f"before {before}, after {after}; expected {old:g} then {new:g}")


def check_run(run_dir: Path | str, kl0: float = KL0, lr0: float = LR0) -> list[Check]:
    """Every verdict the smoke test makes about a finished run directory."""
    run_dir = Path(run_dir)
    events = rundir.iter_events(run_dir)
    kinds = [e.get("kind") for e in events]
    metrics = _metrics(run_dir)
    live = RunInfo.read(run_dir).live_keys or []
    checks = [
        Check("run.json lists the live keys", KL_KEY in live and LR_KEY in live, f"live_keys={live}"),
        Check("started event", "started" in kinds, f"kinds={sorted(set(map(str, kinds)))}"),
        Check("metrics.jsonl has steps", len(metrics) >= 3, f"steps={sorted(metrics)}"),
        Check("checkpoint events", "checkpoint" in kinds, f"{kinds.count('checkpoint')} checkpoint event(s)"),
        Check("finished event", "finished" in kinds, f"last kinds={kinds[-3:]}"),
        Check("no error events", "error" not in kinds,
              "; ".join(str(e.get("message"))[:200] for e in events if e.get("kind") == "error") or "none"),
    ]
    for key, metric, old, new in ((KL_KEY, KL_METRIC, kl0, 2 * kl0), (LR_KEY, LR_METRIC, lr0, lr0 / 2)):
        event = _applied(events, key)
        checks.append(Check(f"applied event for {key}", event is not None and
                            math.isclose(float(event["applied"][key]), new, rel_tol=1e-6),
                            json.dumps(event, sort_keys=True) if event else "none"))
        if event is not None:
            checks.append(_follows(metrics, metric, int(event["step"]), old, new))
    return checks


# -- zero-patch checks (pure file reading: runs anywhere) -------------------------------------

ZP_STEPS = 8
ZP_MICRO = 4
CLIP_KEY = "actor_rollout_ref.actor.clip_ratio"
MICRO_KEY = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


def _journal(run_dir: Path) -> list[Any]:
    from ppo_watchdog.control.store import Store

    state = run_dir / "state"
    if not state.exists():
        return []
    store = Store(state)
    return [e for rid in store.run_ids() for e in store.journal(rid)]


def _gpu_free_between(samples: list[tuple[float, float]], t0: float, t1: float, free_mib: float = 2048.0) -> bool:
    return any(t0 <= t <= t1 and used < free_mib for t, used in samples)


def check_zero_patch(run_dir: Path | str, lr0: float = LR0) -> list[Check]:
    """Every verdict of the zero-patch part about a finished run directory."""
    import torch

    from ppo_watchdog.protocol import checkpoint as ckpt

    run_dir = Path(run_dir)
    events = rundir.iter_events(run_dir)
    kinds = [e.get("kind") for e in events]
    metrics = _metrics(run_dir)
    info = RunInfo.read(run_dir)
    launches = info.launches
    restarts = [e for e in _journal(run_dir) if e.kind == "restart" and e.status == "done"]
    started = [e for e in events if e.get("kind") == "started"]
    checks = [
        Check("verl's file logger reached the run directory", bool(metrics) and (run_dir / "verl").is_dir(),
              f"steps={sorted(metrics)}"),
        Check("a checkpoint judged complete", any(e.get("kind") == "checkpoint" and e.get("layout") == "verl"
                                                 for e in events), f"{kinds.count('checkpoint')} checkpoint event(s)"),
        Check("finished", "finished" in kinds and max(metrics, default=0) >= ZP_STEPS, f"last kinds={kinds[-3:]}"),
        Check("every relaunch's cost measured", bool(restarts) and all(
            isinstance(e.result.get("relaunch_s"), float) for e in restarts),
            "; ".join(f"{e.result.get('relaunch_s')} s" for e in restarts) or "no restarts"),
    ]
    # The lr change by relaunch.
    lr_restart = next((e for e in restarts if "resumed from a copy" in str(e.payload.get("lr_patch", ""))), None)
    checks.append(Check("lr change resumed from a patched copy", lr_restart is not None,
                        str(lr_restart.payload.get("lr_patch")) if lr_restart else "none"))
    if lr_restart is not None:
        copy = Path(lr_restart.payload["resume_path"])
        optim = ckpt.verl_file(copy / "actor", "optim", 1, 0)
        try:
            loaded = torch.load(optim, weights_only=True, map_location="cpu") if optim.exists() else None
            lr_in_copy = float(loaded["param_groups"][0]["lr"]) if loaded else None
            detail = f"{optim}: lr {lr_in_copy}"
        except Exception as exc:  # noqa: BLE001 - the verdict says why
            lr_in_copy, detail = None, f"{optim}: {type(exc).__name__}: {exc}"
        checks.append(Check("patched copy loads with weights_only=True", optim.exists() and lr_in_copy is not None,
                            detail + (" (pruned by a later launch)" if not optim.exists() else "")))
        step = int(lr_restart.result.get("resume_step") or 0)
        after = [m.get(LR_METRIC) for s, m in sorted(metrics.items()) if s > step and LR_METRIC in m]
        checks.append(Check("actor/lr is the new value after the resume", bool(after) and math.isclose(
            float(after[0]), lr0 / 2, rel_tol=1e-6), f"after step {step}: {after[:3]}"))
        resumed = [int(e.get("resumed_from") or 0) for e in started]
        checks.append(Check("the step count continues after the resume", step in resumed and (step + 1) in metrics,
                            f"resumed_from={resumed}"))
        mem = lr_restart.payload.get("lr_patch_memory") or {}
        grew_kb = (mem.get("peak_rss_kb_after") or 0) - (mem.get("peak_rss_kb_before") or 0)
        bound_kb = (mem.get("bound_bytes") or 0) / 1024
        checks.append(Check("watchdog's peak memory during the patch within its bound", bool(mem) and
                            grew_kb <= 2 * bound_kb + 256 * 1024, f"grew {grew_kb} KiB, bound {bound_kb:.0f} KiB"))
    # clip_ratio by relaunch moves pg_clipfrac.
    clip_at = next((i for i, a in enumerate(launches) if any(str(x).startswith(f"{CLIP_KEY}=") and
                                                             "0.05" in str(x) for x in a["command"])), None)
    if clip_at is not None and clip_at < len(started):
        at = int(started[clip_at].get("resumed_from") or 0)
        before = [m["actor/pg_clipfrac"] for s, m in metrics.items() if s <= at and "actor/pg_clipfrac" in m]
        after_c = [m["actor/pg_clipfrac"] for s, m in metrics.items() if s > at and "actor/pg_clipfrac" in m]
        moved = bool(before and after_c) and sum(after_c) / len(after_c) > sum(before) / len(before)
        bounds = [x for x in launches[clip_at]["command"] if "clip_ratio_" in str(x)]
        checks.append(Check("clip_ratio relaunch moves actor/pg_clipfrac", moved,
                            f"before {before}, after {after_c}; {bounds}"))
    else:
        checks.append(Check("clip_ratio relaunch moves actor/pg_clipfrac", False, "no launch with clip_ratio=0.05"))
    # The injected CUDA OOM.
    oom = next((e for e in events if e.get("kind") == "oom"), None)
    checks.append(Check("injected OOM classified cuda / actor_update", oom is not None and oom.get("memory") == "cuda"
                        and oom.get("site") == "actor_update", json.dumps(oom, sort_keys=True)[:400] if oom else "none"))
    if oom is not None:
        later = [e for e in started if float(e.get("ts") or 0) > float(oom["ts"])]
        remedy = next((a for a in launches[len(started) - len(later):] if any(
            str(x).startswith(f"{MICRO_KEY}=") for x in a["command"])), None)
        micro = next((str(x).split("=", 1)[1] for x in (remedy or {}).get("command", []) if str(x).startswith(f"{MICRO_KEY}=")), None)
        trained = later and any(s > int(later[0].get("resumed_from") or 0) for s in metrics)
        checks.append(Check("OOM remedied with a micro batch verl accepts", micro is not None and int(micro) < ZP_MICRO
                            and bool(trained), f"{MICRO_KEY}={micro}; trained after: {bool(trained)}"))
        samples = [tuple(x) for x in json.loads((run_dir / "gpu_memory.json").read_text())] \
            if (run_dir / "gpu_memory.json").exists() else []
        t1 = float(later[0]["ts"]) if later else float("inf")
        checks.append(Check("GPU free before the relaunch", _gpu_free_between(samples, float(oom["ts"]), t1),  # type: ignore[arg-type]
                            f"{len(samples)} nvidia-smi samples between the OOM and the next start"))
    return checks


def zero_patch_overrides(args: argparse.Namespace, train: Path, val: Path, gpus: int) -> list[str]:
    """The in-process config with zero-patch changes: save_freq=2, 8 steps, no glue."""
    out = [o for o in verl_overrides(args, train, val, gpus)
           if not o.startswith(("trainer.save_freq=", "trainer.total_training_steps=", "trainer.resume_mode="))]
    return [*out, "trainer.save_freq=2", f"trainer.total_training_steps={ZP_STEPS}", "trainer.resume_mode=auto"]


def _sample_gpu(out: Path, stop: Any) -> None:
    samples: list[tuple[float, float]] = []
    while not stop.is_set():
        try:
            txt = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout
            samples.append((time.time(), sum(float(x) for x in txt.split())))
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        stop.wait(0.5)
    out.write_text(json.dumps(samples))


def run_zero_patch(args: argparse.Namespace, run_dir: Path, gpus: int) -> int:
    """An unmodified verl under ``watchdog run --mode verl``; returns the watchdog's exit code."""
    import threading

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    train, val = write_data(run_dir / "data", n_train=64 * gpus, n_val=32)
    trainer = [sys.executable, "-m", "verl.trainer.main_ppo", *zero_patch_overrides(args, train, val, gpus),
               *args.overrides]
    watchdog = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--mode", "verl",
                "--rules", str(REPO / "bench" / "verl_gpu_smoke_zero_patch.yaml"), "--state-dir", str(run_dir / "state"),
                "--tick", "1", "--startup-timeout", str(args.timeout), "--heartbeat-min", "600",
                "--restart-budget", "1", "--tuning-relaunch-every", "0", "--stop-grace", "60", "--no-report"]
    cmd = watchdog + ["--", *trainer]
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", SMOKE_OOM_RUN_DIR=str(run_dir), SMOKE_OOM_ATTEMPT="3",
               PYTHONPATH=os.pathsep.join([str(REPO / "bench" / "smoke_inject"), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_gpu, args=(run_dir / "gpu_memory.json", stop), daemon=True)
    sampler.start()
    t0 = time.time()
    try:
        code = subprocess.run(cmd, cwd=REPO, env=env, timeout=args.zero_patch_timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"zero-patch run timed out after {time.time() - t0:.0f} s", file=sys.stderr)
        code = 124
    finally:
        stop.set()
        sampler.join(10)
    print(f"zero-patch watchdog run exited {code} after {time.time() - t0:.0f} s", flush=True)
    return code


# -- the run (GPU) ----------------------------------------------------------------------------

TINY = "tiny-random"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_model(out: Path, texts: list[str]) -> Path:
    """A randomly initialised 2-layer Qwen2 with a byte-level BPE tokenizer trained on ``texts``.

    For machines that cannot download a model: the smoke test checks the glue (events,
    applied values, logged lr and kl_coef), not what the model learns. head_dim 64 and
    GQA keep vLLM's attention backends happy.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)
    vocab = ((len(fast) + 63) // 64) * 64
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None,
                      tie_word_embeddings=True, torch_dtype="bfloat16")
    Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def write_data(out: Path, n_train: int, n_val: int) -> tuple[Path, Path]:
    """The synthetic task as GSM8K rows verl's default reward scores (data_source openai/gsm8k)."""
    from ppo_watchdog.trainer.data import synthetic_rows, write_parquet

    rows = synthetic_rows(n_train, n_val, max_operand=20, seed=0, heldout=False)
    for split in rows.values():
        for r in split:
            r["data_source"] = "openai/gsm8k"
            r["prompt"] = [{"role": "user", "content": r["prompt"][0]["content"] + SUFFIX}]
    return write_parquet(rows["train"], out / "train.parquet"), write_parquet(rows["val"], out / "test.parquet")


def prepare(args: argparse.Namespace, run_dir: Path, gpus: int) -> list[str]:
    """Data (and the tiny model when asked) in the run directory; returns the trainer's command."""
    from ppo_watchdog.trainer.data import synthetic_rows

    train, val = write_data(run_dir / "data", n_train=64 * gpus, n_val=32)
    if args.model == TINY:
        texts = [r["prompt"][0]["content"] + SUFFIX + " #### " + r["reward_model"]["ground_truth"]
                 for r in synthetic_rows(441, 0, max_operand=20, seed=0)["train"]]
        args.model = str(make_tiny_model(run_dir / "tiny-model", texts))
    return [sys.executable, "-m", "ppo_watchdog.trainer.verl_glue", "--run-dir", str(run_dir),
            *verl_overrides(args, train, val, gpus), *args.overrides]


def verl_overrides(args: argparse.Namespace, train: Path, val: Path, gpus: int) -> list[str]:
    """A tiny verl PPO config: GAE with a critic, KL in the reward (fixed), vLLM rollout."""
    batch = max(8, 8 * gpus)
    return [
        f"data.train_files={train}", f"data.val_files={val}", f"data.train_batch_size={batch}",
        "data.max_prompt_length=128", "data.max_response_length=64", "data.filter_overlong_prompts=true",
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=fixed",
        f"algorithm.kl_ctrl.kl_coef={KL0}",
        f"actor_rollout_ref.model.path={args.model}", f"actor_rollout_ref.actor.optim.lr={LR0}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        f"critic.model.path={args.model}", "critic.optim.lr=1e-5", "critic.ppo_micro_batch_size_per_gpu=4",
        f"critic.ppo_mini_batch_size={batch}",
        f"trainer.n_gpus_per_node={gpus}", "trainer.nnodes=1", f"trainer.total_training_steps={args.steps}",
        "trainer.save_freq=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console]", "trainer.project_name=watchdog_smoke", "trainer.experiment_name=verl_glue",
        "trainer.resume_mode=disable",
    ]


def run(args: argparse.Namespace) -> int:
    """Launch the run under the watchdog; returns its exit code."""
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: this is the GPU smoke test (use --check-only RUN_DIR on CPU)", file=sys.stderr)
        return 2
    gpus = args.gpus or torch.cuda.device_count()
    run_dir = Path(args.run_dir).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    trainer = prepare(args, run_dir, gpus)
    watchdog = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--mode", "embedded",
                "--rules", str(REPO / "bench" / "verl_gpu_smoke.yaml"), "--state-dir", str(run_dir / "state"),
                "--tick", "2", "--startup-timeout", str(args.timeout), "--heartbeat-min", "600",
                "--live-timeout", "900", "--restart-budget", "0", "--no-report"]
    cmd = watchdog + ["--", *trainer]
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=args.timeout + 120 * args.steps)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        print(f"timed out after {time.time() - t0:.0f} s", file=sys.stderr)
        code = 124
    print(f"watchdog run exited {code} after {time.time() - t0:.0f} s", flush=True)
    return code


def dry_run(args: argparse.Namespace) -> int:
    """The CPU-runnable part of :func:`run`: data, model, the composed and validated verl config."""
    from ppo_watchdog.trainer.verl_glue.runner import build_config, validate

    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = prepare(args, run_dir, args.gpus or 1)
    overrides = cmd[cmd.index("--run-dir") + 2:]
    cfg = build_config(overrides, run_dir)
    validate(cfg)
    print("$", " ".join(cmd))
    print(f"config valid: trainer_mode={cfg.trainer.v1.trainer_mode}, checkpoints in {cfg.trainer.default_local_dir}")
    # The zero-patch part's command, composed with verl's own ppo_trainer.yaml and checked by verl.
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from ppo_watchdog.trainer.verl_glue.runner import verl_config_dir

    train, val = run_dir / "data" / "train.parquet", run_dir / "data" / "test.parquet"
    zp = zero_patch_overrides(args, train, val, args.gpus or 1)
    with initialize_config_dir(version_base=None, config_dir=str(verl_config_dir())):
        zcfg = compose(config_name="ppo_trainer", overrides=zp)
    validate_config(config=zcfg, use_reference_policy=need_reference_policy(zcfg), use_critic=need_critic(zcfg))
    print("$ python3 -m verl.trainer.main_ppo", " ".join(zp))
    print(f"zero-patch config valid: save_freq={zcfg.trainer.save_freq}, steps={zcfg.trainer.total_training_steps}")
    return 0


def report(run_dir: Path, checks: list[Check], code: int | None) -> int:
    """Print the verdicts, write RUN_DIR/smoke.json; 0 when all passed."""
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    ok = all(c.ok for c in checks) and code in (None, 0)
    (run_dir / "smoke.json").write_text(json.dumps(
        {"ok": ok, "watchdog_exit": code, "checks": [asdict(c) for c in checks]}, indent=2) + "\n")
    print(f"{sum(c.ok for c in checks)} passed, {sum(not c.ok for c in checks)} failed")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("SMOKE_MODEL", "Qwen/Qwen2.5-0.5B-Instruct"),
                   help=f"Local model directory, an HF id already cached, or {TINY!r} (a random 2-layer Qwen2 "
                        "built here: no download). Default $SMOKE_MODEL or Qwen/Qwen2.5-0.5B-Instruct.")
    p.add_argument("--run-dir", default="runs/verl-gpu-smoke", help="Run directory (replaced).")
    p.add_argument("--steps", type=int, default=6, help="PPO steps (>= 5: the changes come at steps 2 and 3).")
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: all visible).")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of each GPU.")
    p.add_argument("--timeout", type=int, default=900, help="Seconds allowed for start-up (model load, vLLM).")
    p.add_argument("--check-only", metavar="RUN_DIR", help="Only check an existing run directory (no GPU).")
    p.add_argument("--check-zero-patch", metavar="RUN_DIR", help="Only check an existing zero-patch run directory.")
    p.add_argument("--mode", choices=("both", "zero-patch", "in-process"), default="both",
                   help="zero-patch: an unmodified verl relaunched by the watchdog; in-process: the glue's live "
                        "changes; both (default): zero-patch in RUN_DIR/zero_patch, then in-process in RUN_DIR.")
    p.add_argument("--zero-patch-timeout", type=int, default=420, help="Seconds allowed for the zero-patch run.")
    p.add_argument("--dry-run", action="store_true", help="Prepare data (and the tiny model), compose and "
                   "validate the verl config, print the command; no GPU, no training.")
    p.add_argument("overrides", nargs="*", help="Extra verl KEY=VALUE overrides.")
    args = p.parse_args(argv)
    if args.check_only:
        run_dir = Path(args.check_only)
        return report(run_dir, check_run(run_dir), None)
    if args.check_zero_patch:
        run_dir = Path(args.check_zero_patch)
        return report(run_dir, check_zero_patch(run_dir), None)
    if args.steps < 5:
        p.error("--steps must be at least 5")
    if args.dry_run:
        return dry_run(args)
    zp_failed = 0
    if args.mode in ("both", "zero-patch"):
        import torch

        if not torch.cuda.is_available():
            print("no CUDA GPU: this is the GPU smoke test (use --check-zero-patch RUN_DIR on CPU)", file=sys.stderr)
            return 2
        base = Path(args.run_dir).resolve()
        zp_dir = base / "zero_patch" if args.mode == "both" else base
        if args.mode == "both" and base.exists():
            shutil.rmtree(base)
        if args.model == TINY:  # built once, outside the run directories, for both parts
            from ppo_watchdog.trainer.data import synthetic_rows

            texts = [r["prompt"][0]["content"] + SUFFIX + " #### " + r["reward_model"]["ground_truth"]
                     for r in synthetic_rows(441, 0, max_operand=20, seed=0)["train"]]
            args.model = str(make_tiny_model(base.parent / f"{base.name}-tiny-model", texts))
        zp_code = run_zero_patch(args, zp_dir, args.gpus or torch.cuda.device_count())
        zp_failed = report(zp_dir, check_zero_patch(zp_dir), zp_code)
        if args.mode == "zero-patch":
            return zp_failed
        args.run_dir = str(base / "in_process")
    code = run(args)
    if code == 2 and not Path(args.run_dir, rundir.EVENTS).exists():
        return 2
    run_dir = Path(args.run_dir).resolve()
    return report(run_dir, check_run(run_dir), code) or zp_failed


if __name__ == "__main__":
    sys.exit(main())
