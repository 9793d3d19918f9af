"""Submit a PPO run as a Ray Job, watched by the watchdog.

Two ways, both against a Ray cluster whose nodes share the run directory (NFS, a PVC, ...):

1. The watchdog supervises the job itself (restarts, OOM retries, rollbacks by resubmission):

       watchdog run --ray-address http://127.0.0.1:8265 --run-dir /srv/runs/demo -- \\
           python -m ppo_watchdog.trainer trainer.run_dir=/srv/runs/demo trainer.metrics_port=9400

2. This script submits the trainer as a plain Ray Job and a `watchdog daemon` (deploy/watchdog/
   daemon.yaml lists /srv/runs/*) watches its run directory and acts live through control.json:

       python deploy/ray/submit_job.py --address http://127.0.0.1:8265 --run-dir /srv/runs/demo

The address is Ray's dashboard (job submission) address; keep it on 127.0.0.1 or a private network.
A cluster with token authentication (current Ray's default) needs its token: --token-file FILE, else
where Ray looks ($RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), as the watchdog does.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

log = logging.getLogger("submit_job")


def entrypoint(run_dir: str, metrics_port: int, overrides: list[str]) -> str:
    """The shell command the Ray Job runs: the embedded trainer with verl's Hydra keys."""
    args = [
        "python", "-m", "ppo_watchdog.trainer",
        f"trainer.run_dir={run_dir}",
        f"trainer.metrics_port={metrics_port}",
        "trainer.progress=false",
        *overrides,
    ]
    return shlex.join(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="http://127.0.0.1:8265", help="Ray job submission address.")
    parser.add_argument("--run-dir", required=True, help="Run directory on storage every node shares.")
    parser.add_argument("--metrics-port", type=int, default=9400, help="Trainer /metrics port (0: off).")
    parser.add_argument("--submission-id", default=None, help="Ray submission id (default: Ray picks one).")
    parser.add_argument("--token-file", default=None, help="File holding the cluster's auth token "
                        "(default: where Ray looks).")
    parser.add_argument("overrides", nargs="*", help="Trainer overrides, key=value (verl's Hydra keys).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    from ray.job_submission import JobSubmissionClient  # heavy; only when submitting

    from ppo_watchdog.backends.ray_jobs import find_token

    client = JobSubmissionClient(args.address, headers=find_token(args.token_file).headers() or None)
    job_id = client.submit_job(
        entrypoint=entrypoint(args.run_dir, args.metrics_port, args.overrides),
        submission_id=args.submission_id,
        # One CPU per job: the embedded trainer runs with trainer.num_threads=1.
        entrypoint_num_cpus=1,
        metadata={"run_dir": args.run_dir, "app": "ppo-watchdog"},
    )
    log.info("submitted %s; follow with: ray job logs --address %s -f %s", job_id, args.address, job_id)
    sys.stdout.write(job_id + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
