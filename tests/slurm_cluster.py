"""A real single-node SLURM (Debian's slurm-wlm 22.05 + munge) started and stopped by the tests.

    with SlurmCluster(tmp_path) as cluster:          # slurmctld + slurmd up, node idle, SLURM_CONF set
        job_id = cluster.sbatch("--wrap=hostname")    # sbatch/squeue/scontrol/scancel and submitit all find it
        cluster.wait_finished(job_id)
        cluster.preempt(submitit_job.job_id)          # what preemption / a time limit does to a submitit job

Needs root (slurmd as root, as CI runs) and Debian's `slurm-wlm` and `munge` (`.ci/run` installs them).
Every failure raises RuntimeError naming the step, with the command's output or the daemon log's tail.
The settings are the ones measured to work in these containers: no cgroup plugins (proctrack/linuxproc,
task/none), so SLURM enforces neither the CPUs nor the memory a job asked for.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

MUNGE_KEY = Path("/etc/munge/munge.key")
PARTITION = "debug"
# slurmd puts unix sockets for job steps in its spool folder; their paths must fit in sockaddr_un (108 bytes).
MAX_SPOOL_PATH = 70
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def _run(step: str, cmd: list[str], timeout: float = 30, **kwargs) -> str:
    """Run a command; on failure raise RuntimeError naming the step with the command's own output."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"SLURM test cluster: {step}: {' '.join(cmd)} failed: {error}") from error
    if proc.returncode != 0:
        raise RuntimeError(
            f"SLURM test cluster: {step}: {' '.join(cmd)} exited with {proc.returncode}\n"
            f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}"
        )
    return proc.stdout


def _tool(name: str) -> str:
    """Full path of a SLURM or munge program (daemons live in /usr/sbin, which a non-login PATH may lack)."""
    found = shutil.which(name) or next(
        (f"{d}/{name}" for d in ("/usr/sbin", "/usr/bin") if Path(d, name).exists()), None
    )
    if found is None:
        raise RuntimeError(
            f"SLURM test cluster: preflight: `{name}` is not installed (apt-get install slurm-wlm munge)"
        )
    return found


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return f"--- last {len(text)} lines of {path} ---\n" + "\n".join(text)


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie counts as gone (PID 1 in these containers may not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _pending(pid: int, signum: int) -> bool:
    """True while `signum` waits, sent but not delivered, on process `pid` (a stopped process keeps it pending)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    bit = 1 << (signum - 1)
    return bool((int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)) & bit)


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (held open together, so they are distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def munge_works() -> bool:
    try:
        credential = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, check=True).stdout
        subprocess.run(["unmunge"], input=credential, capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def ensure_munge() -> None:
    """A munged that answers `munge -n | unmunge`: reuse a running one, else start one as the munge user.

    munged is left running afterwards: it is shared by every cluster (and test session) on the machine.
    """
    if munge_works():
        return
    munged, runuser = _tool("munged"), _tool("runuser")
    try:
        user = pwd.getpwnam("munge")
    except KeyError as error:
        raise RuntimeError("SLURM test cluster: munge: no `munge` user (apt-get install munge)") from error
    for folder in ("/etc/munge", "/var/lib/munge", "/var/log/munge", "/run/munge"):
        os.makedirs(folder, exist_ok=True)
        os.chown(folder, user.pw_uid, user.pw_gid)
    os.chmod("/run/munge", 0o755)  # munged's socket folder must be open to all (the tests run under umask 077)
    if not MUNGE_KEY.exists():
        MUNGE_KEY.write_bytes(os.urandom(1024))
    os.chown(MUNGE_KEY, user.pw_uid, user.pw_gid)
    os.chmod(MUNGE_KEY, 0o400)
    try:
        _run("munge: start munged", [runuser, "-u", "munge", "--", munged])
    except RuntimeError:
        time.sleep(1)  # another test session may have started one just now
        if not munge_works():
            raise
    deadline = time.monotonic() + 10
    while not munge_works():
        if time.monotonic() > deadline:
            raise RuntimeError(
                "SLURM test cluster: munge: munged started but `munge -n | unmunge` fails\n"
                + _tail(Path("/var/log/munge/munged.log"))
            )
        time.sleep(0.2)


def node_resources() -> tuple[int, int]:
    """(CPUs, RealMemory in MB) as slurmd itself detects them, so that the node registers without a mismatch."""
    fields = dict(item.split("=", 1) for item in _run("detect node", [_tool("slurmd"), "-C"]).split() if "=" in item)
    return int(fields["CPUs"]), int(fields["RealMemory"])


class SlurmCluster:
    """slurmctld + slurmd for this host, configured and logged under `workdir`; use as a context manager."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        startup_timeout: float = 30.0,
        def_mem_per_cpu_mb: int = 1000,
        cred_expire_s: int = 5,
    ):
        self.workdir = Path(workdir).resolve()
        self.conf = self.workdir / "slurm.conf"
        self.startup_timeout = startup_timeout
        self.def_mem_per_cpu_mb = def_mem_per_cpu_mb
        self.cred_expire_s = cred_expire_s
        self.host = socket.gethostname().split(".")[0]  # slurmd finds its NodeName by the short host name
        self.started_s: float | None = None  # how long start() took
        self.ports: tuple[int, int] | None = None  # (SlurmctldPort, SlurmdPort)
        self._saved_env: str | None = None
        self._env_set = False

    # ---- paths ---------------------------------------------------------------------------------------------------
    def pid_file(self, daemon: str) -> Path:
        return self.workdir / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.workdir / f"{daemon}.log"

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise RuntimeError("SLURM test cluster: preflight: slurmd must run as root (CI runs as root)")
        for tool in ("sbatch", "sinfo", "scontrol", "scancel", "squeue", "srun", "munge", "unmunge"):
            _tool(tool)
        ensure_munge()
        self.write_config()
        self._saved_env, self._env_set = os.environ.get("SLURM_CONF"), True
        os.environ["SLURM_CONF"] = str(self.conf)
        try:
            self._start_daemon("slurmctld")
            self._start_daemon("slurmd")
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0

    def write_config(self) -> None:
        spool = self.workdir / "spool"
        if len(str(spool)) > MAX_SPOOL_PATH:
            raise RuntimeError(
                f"SLURM test cluster: config: workdir {self.workdir} is too long for slurmd's step sockets "
                f"(keep '<workdir>/spool' under {MAX_SPOOL_PATH} characters)"
            )
        for folder in (self.workdir / "state", spool):
            folder.mkdir(parents=True, exist_ok=True)
        cpus, memory_mb = node_resources()
        ctld_port, slurmd_port = _free_ports(2)
        self.ports = (ctld_port, slurmd_port)
        lines = [
            f"ClusterName=test{ctld_port}",
            # Loopback addresses: nothing depends on the host name resolving (fresh CI containers).
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A requeued job may start again only once its revoked job credential expired: cred_expire + 1 s
            # (default 120 s; a job started sooner is killed with "Job credential revoked").
            f"AuthInfo=cred_expire={self.cred_expire_s}",
            f"StateSaveLocation={self.workdir / 'state'}",
            f"SlurmdSpoolDir={spool}",
            f"SlurmctldPidFile={self.pid_file('slurmctld')}",
            f"SlurmdPidFile={self.pid_file('slurmd')}",
            f"SlurmctldLogFile={self.log_file('slurmctld')}",
            f"SlurmdLogFile={self.log_file('slurmd')}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # The cgroup plugins do not work in these containers.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            # Without a default, a job that does not say --mem gets the whole node and runs alone.
            f"DefMemPerCPU={self.def_mem_per_cpu_mb}",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            # Schedule at once and every second (defaults: batch jobs may wait 3 s, the main loop runs every 60 s).
            "SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1",
            "KillWait=5",
            "InactiveLimit=0",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_daemon(self, daemon: str) -> None:
        pid_file = self.pid_file(daemon)
        pid_file.unlink(missing_ok=True)
        try:
            _run(f"start {daemon}", [_tool(daemon), "-f", str(self.conf)])
        except RuntimeError as error:
            raise RuntimeError(f"{error}\n{_tail(self.log_file(daemon))}") from None
        deadline = time.monotonic() + 10
        while True:
            pid = self._pid(daemon)
            if pid is not None and _alive(pid):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SLURM test cluster: start {daemon}: no live process behind {pid_file} after 10 s\n"
                    + _tail(self.log_file(daemon))
                )
            time.sleep(0.1)

    def _pid(self, daemon: str) -> int | None:
        try:
            return int(self.pid_file(daemon).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def daemons_alive(self) -> dict[str, bool]:
        return {d: (pid := self._pid(d)) is not None and _alive(pid) for d in ("slurmctld", "slurmd")}

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        state = ""
        while time.monotonic() < deadline:
            for daemon, alive in self.daemons_alive().items():
                if not alive:
                    raise RuntimeError(f"SLURM test cluster: wait for node: {daemon} died\n" + self.logs())
            proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=10)
            state = proc.stdout.strip() or proc.stderr.strip()
            if state == "idle":
                return
            time.sleep(0.3)
        node = subprocess.run(["scontrol", "show", "node", self.host], capture_output=True, text=True).stdout
        raise RuntimeError(
            f"SLURM test cluster: wait for node: {self.host} not idle after {self.startup_timeout:.0f} s "
            f"(sinfo: {state!r})\n{node}\n{self.logs()}"
        )

    def stop(self) -> None:
        """Cancel what is left, stop slurmd then slurmctld by their pid files, restore SLURM_CONF."""
        try:
            if self._pid("slurmctld") is not None:
                subprocess.run(["scancel", f"--partition={PARTITION}"], capture_output=True, timeout=10)
            for daemon in ("slurmd", "slurmctld"):
                self._stop_daemon(daemon)
        finally:
            if self._env_set:
                if self._saved_env is None:
                    os.environ.pop("SLURM_CONF", None)
                else:
                    os.environ["SLURM_CONF"] = self._saved_env
                self._env_set = False

    def _stop_daemon(self, daemon: str, timeout: float = 15) -> None:
        pid = self._pid(daemon)
        if pid is None or not _alive(pid):
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                raise RuntimeError(
                    f"SLURM test cluster: stop {daemon}: pid {pid} ignored SIGTERM for {timeout:.0f} s (killed)\n"
                    + _tail(self.log_file(daemon))
                )
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(_tail(self.log_file(d)) for d in ("slurmctld", "slurmd"))

    # ---- jobs ----------------------------------------------------------------------------------------------------
    def sbatch(self, *args: str) -> str:
        """Submit with sbatch; returns the job id."""
        out = _run("sbatch", ["sbatch", "--parsable", *args])
        return out.strip().split(";")[0]

    def job_states(self, job_id: str) -> dict[str, str]:
        """{job id (array tasks as 'A_i'): state} from scontrol, which remembers finished jobs for MinJobAge (300 s)."""
        out = _run("job state", ["scontrol", "show", "job", "-o", job_id])
        states = {}
        for line in out.splitlines():
            fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
            if "ArrayTaskId" in fields:
                key = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"
            else:
                key = fields["JobId"]
            states[key] = fields["JobState"]
        return states

    def wait_finished(self, job_id: str, timeout: float = 30) -> dict[str, str]:
        """Wait until every task of the job reached a terminal state; returns their states."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.job_states(job_id)
            if states and all(state in TERMINAL_STATES for state in states.values()):
                return states
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM test cluster: job {job_id} unfinished after {timeout:.0f} s: {states}")
            time.sleep(0.3)

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` of one job (or one array task 'A_i') as a dict."""
        out = _run("job fields", ["scontrol", "show", "job", "-o", job_id])
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def preempt(self, job_id: str, sigterm_first: bool = False, timeout: float = 120,
                stopped_pid: int | None = None, log: Path | None = None) -> None:
        """Do to a running submitit job what preemption or a time limit does; return once SLURM requeued it.

        submitit writes `#SBATCH --signal=USR2@<signal_delay_s>` and runs python in a job step (`srun`). On USR2
        its handler calls the callable's checkpoint(), pickles the returned DelayedSubmission over the job's
        submitted pickle, runs `scontrol requeue <job id>` and exits; SLURM then runs the job again from that pickle
        (after cred_expire + 1 s, see write_config), with SLURM_RESTART_COUNT one higher.
        `scancel --signal=USR2` without --batch/--full signals the job steps only, as `--signal=USR2@...` does; the
        batch shell, which USR2 would kill, is spared. `sigterm_first` sends SIGTERM before, as submitit's own
        test hook job._interrupt() does for a preemption (submitit's handler ignores SIGTERM; PyTorch Lightning's
        does not: it stops fit() with SIGTERMException at the next batch).
        Send it only once the job's function runs: before submitit installed its handler USR2 kills python.

        `scancel --signal` returns once slurmctld has queued the signal, not once it reached the job, and two queued
        signals may arrive in either order. A SIGTERM that comes late, while the USR2 handler's `scontrol requeue`
        runs, kills that scontrol (every process of the step is signalled) and the job ends instead of requeueing.
        So with `sigterm_first` USR2 is sent only once the SIGTERM got there: for a running job once submitit has
        logged it ("Bypassing signal SIGTERM" in `log`, the job's stderr file); for a held one once it is pending.
        `stopped_pid`: the job's python, which the caller stopped (SIGSTOP) at the moment it chose; it is continued
        only once both signals are pending on it, so the job is preempted exactly where it was held.
        """
        deadline = time.monotonic() + timeout
        fields = self.job_fields(job_id)
        if fields["JobState"] != "RUNNING":
            raise RuntimeError(f"SLURM test cluster: preempt: job {job_id} is {fields['JobState']}, not RUNNING")
        restarts = int(fields["Restarts"])
        if sigterm_first:
            if stopped_pid is None and log is None:
                raise ValueError("preempt: sigterm_first on a running job needs its stderr file (log=)")
            seen = self._bypassed_sigterms(log) if stopped_pid is None else 0
            _run("preempt: SIGTERM", ["scancel", "--signal=TERM", job_id])
            if stopped_pid is None:
                self._wait_for(lambda: self._bypassed_sigterms(log) > seen, deadline,
                               f"job {job_id} never logged the SIGTERM in {log}")
            else:
                self._wait_for(lambda: _pending(stopped_pid, signal.SIGTERM), deadline,
                               f"the SIGTERM never reached the held pid {stopped_pid} of job {job_id}")
        _run("preempt: USR2", ["scancel", "--signal=USR2", job_id])
        if stopped_pid is not None:
            self._wait_for(lambda: _pending(stopped_pid, signal.SIGUSR2), deadline,
                           f"the USR2 never reached the held pid {stopped_pid} of job {job_id}")
            os.kill(stopped_pid, signal.SIGCONT)
        while True:
            fields = self.job_fields(job_id)
            if int(fields["Restarts"]) > restarts:
                return
            if fields["JobState"] in TERMINAL_STATES or time.monotonic() > deadline:
                raise RuntimeError(
                    f"SLURM test cluster: preempt: job {job_id} was not requeued (JobState={fields['JobState']}, "
                    f"Restarts={fields['Restarts']}); a job requeues itself only if its callable has checkpoint()\n"
                    + self.logs()
                )
            time.sleep(0.2)

    @staticmethod
    def _bypassed_sigterms(log: Path) -> int:
        """How many SIGTERMs submitit's handler has logged (at WARNING, to the job's stderr) so far."""
        return log.read_text(errors="replace").count("Bypassing signal SIGTERM") if log.exists() else 0

    def _wait_for(self, condition, deadline: float, what: str) -> None:
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM test cluster: preempt: {what}\n{self.logs()}")
            time.sleep(0.05)

    @staticmethod
    def wait_for_submitit(jobs: Iterable, timeout: float = 60) -> None:
        """Wait for submitit jobs with a deadline: without accounting (no sacct) submitit cannot see that a job
        died without a result, and job.result() would wait forever."""
        deadline = time.monotonic() + timeout
        jobs = list(jobs)
        while not all(job.done() for job in jobs):
            if time.monotonic() > deadline:
                pending = [job.job_id for job in jobs if not job.done()]
                logs = "\n".join(f"{job.job_id} stderr:\n{job.stderr()}" for job in jobs if not job.done())
                raise RuntimeError(
                    f"SLURM test cluster: submitit jobs {pending} unfinished after {timeout:.0f} s\n{logs}"
                )
            time.sleep(0.5)
