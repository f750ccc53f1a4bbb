"""A real SLURM cluster on loopback for the tests: munged, slurmctld and one slurmd per emulated node, all
state under one temporary directory, every daemon stopped by PID at the end (Debian 12's slurm-wlm 22.05)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 1, cpus_per_node: int = 4):
        self.root, self.nodes = Path(root), [f"node{i + 1}" for i in range(nodes)]
        self.root.mkdir(parents=True, exist_ok=True)
        self.conf = self.root / "slurm.conf"
        # Clients (sbatch, scontrol) and jobs find the cluster through SLURM_CONF.
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
            self.env.pop(var, None)
        self.cpus = cpus_per_node
        self.pid_files: list[Path] = []

    def start(self) -> "SlurmCluster":
        root, host = self.root, socket.gethostname()
        munge_dir = root / "munge"
        munge_dir.mkdir(exist_ok=True)
        munge_dir.chmod(0o755)  # munged refuses a socket directory others cannot traverse
        key = root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        sock = munge_dir / "munge.socket.2"
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        for d in ("state", "spool"):
            (root / d).mkdir(exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} "
                          "RealMemory=8000 State=UNKNOWN" for n, p in zip(self.nodes, node_ports))
        # The schedulers run every second (defaults: 30 s and 60 s), so a requeued job restarts at once.
        self.conf.write_text(f"""ClusterName=grttest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
SchedulerParameters=bf_interval=1,sched_interval=1
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self.pid_files = [root / "munged.pid", root / "slurmctld.pid", *(root / f"slurmd-{n}.pid" for n in self.nodes)]
        self._run(["munged", "--force", f"--key-file={key}", f"--socket={sock}", f"--pid-file={root}/munged.pid",
                   f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"])
        self._run(["slurmctld", "-c"])
        for n in self.nodes:
            self._run(["slurmd", "-N", n])
        deadline = time.time() + 30
        while time.time() < deadline:
            states = self.scontrol("show", "nodes", "-o")
            if states.count("State=IDLE") == len(self.nodes):
                return self
            time.sleep(0.1)
        raise RuntimeError(f"cluster did not come up: {states}\n{(root / 'slurmctld.log').read_text()[-2000:]}")

    def _run(self, cmd):
        subprocess.run(cmd, env=self.env, check=True, capture_output=True, timeout=30)

    def scontrol(self, *args) -> str:
        return subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=30).stdout

    def job(self, job_id: str) -> dict:
        line = self.scontrol("show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait(self, job_id: str, states=("COMPLETED",), timeout: float = 300, restarts: int = 0) -> dict:
        """Until the job reaches a final state (after at least `restarts` requeues); returns its fields."""
        deadline = time.time() + timeout
        final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in final and int(info.get("Restarts", 0)) >= restarts:
                assert info["JobState"] in states, (info, self.log_tail())
                return info
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s")

    def log_tail(self) -> str:
        return (self.root / "slurmctld.log").read_text()[-3000:]

    def stop(self) -> None:
        for pid_file in reversed(self.pid_files):
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
