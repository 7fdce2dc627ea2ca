"""The engines users run, started for real on this machine, on loopback: SLURM's daemons (munged,
slurmctld, slurmd) for one node named localhost, Open MPI's ``mpirun`` (nothing to start), and a
Ray head. Each helper says why it cannot start (not installed, not root) so the tests skip with
that reason. Notes on each engine: docs/clusters.md and shared/notes/engines.md."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

SLURM_CONF = """\
ClusterName=trainkit
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/d
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=localhost CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def missing(*programs: str) -> str | None:
    """Why these programs cannot run here (for a skip), or None."""
    absent = [p for p in programs if shutil.which(p) is None and not os.path.exists(p)]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm openmpi-bin)"
    if os.geteuid() != 0:
        return "the daemons need root"
    return None


def _wait(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {seconds:g} s")
        time.sleep(0.1)


def _stop(pid_file: pathlib.Path, seconds: float = 20) -> None:
    """Ends the daemon whose PID the file holds and waits until it has exited."""
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().split()[0])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    with contextlib.suppress(TimeoutError):
        _wait(gone, seconds, f"pid {pid}")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def slurm(root: pathlib.Path):
    """SLURM on localhost: yields the environment (``SLURM_CONF``) srun and sbatch need; stops the
    daemons in the order slurmd, slurmctld, munged once no job is left (stopped together,
    slurmstepd keeps retrying)."""
    for folder in ("ctld", "d"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root))
    env = dict(os.environ, SLURM_CONF=str(conf))
    started_munge = False
    if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:  # no munged yet: ours
        pathlib.Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
        started_munge = True
    try:
        subprocess.run(["/usr/sbin/slurmctld"], env=env, check=True)
        subprocess.run(["/usr/sbin/slurmd", "-N", "localhost"], env=env, check=True)

        def idle() -> bool:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            return state.strip() == "idle"

        _wait(idle, 30, "SLURM's node is not idle")
        yield env
    finally:
        with contextlib.suppress(TimeoutError):
            _wait(lambda: not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout, 30, "")
        _stop(root / "slurmd.pid")
        _stop(root / "slurmctld.pid")
        if started_munge:
            _stop(pathlib.Path("/run/munge/munged.pid"))


@contextlib.contextmanager
def ray_head(root: pathlib.Path, env: dict[str, str]):
    """A Ray head on 127.0.0.1 (4 logical CPUs); yields its address. ``ray stop`` ends every Ray
    process of the machine."""
    ray = pathlib.Path(sys.executable).parent / "ray"
    command = [str(ray), "start", "--head", "--node-ip-address=127.0.0.1", "--num-cpus=4", "--include-dashboard=false"]
    command += [f"--temp-dir={root}", "--disable-usage-stats"]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=120)
    try:
        yield "127.0.0.1:6379"
    finally:
        subprocess.run([str(ray), "stop", "--force"], env=env, capture_output=True, timeout=120)
