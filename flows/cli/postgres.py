"""A throwaway PostgreSQL cluster on 127.0.0.1 for a Prefect server: tests, benchmarks and the
loopback walk-through of docs/scale-out.md (infra/scale_out_local.py) all use this one.

It runs Debian's server binaries (package `postgresql`) from a fresh temporary folder on a free
port, with trust authentication on loopback only. PostgreSQL refuses to run as root: as root,
the cluster belongs to the `postgres` user the package creates, and commands run through
`runuser`. A team's real server is the compose file's `postgres` service (infra/).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
from pathlib import Path

from flows.cli.loopback_server import LoopbackServer

USER = "sdpipe"


def bin_dir() -> Path | None:
    """The folder of `initdb` and `pg_ctl`: on PATH, else Debian's newest version."""
    if found := shutil.which("initdb"):
        return Path(found).resolve().parent
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(versions[-1]).parent if versions else None


def unavailable_reason() -> str | None:
    """Why no cluster can be started here, or None if one can."""
    if bin_dir() is None:
        return "PostgreSQL server binaries not found (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run PostgreSQL as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing"
    try:
        import asyncpg  # noqa: F401  (Prefect's Postgres driver)
    except ImportError:
        return "asyncpg is not installed"
    return None


class Postgres(LoopbackServer):
    """`with Postgres() as pg: pg.url("prefect")` — a started cluster, removed on exit."""

    folder_prefix = "sdpipe-pg-"
    unavailable_reason = staticmethod(unavailable_reason)

    def __init__(self, port: int | None = None):
        super().__init__(port)
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.bin = bin_dir()
        self._as_postgres = os.geteuid() == 0

    def _run(self, *command: str) -> subprocess.CompletedProcess:
        cmd = [str(self.bin / command[0]), *command[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=self.dir)
        if done.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stdout}{done.stderr}{log}")
        return done

    def _start(self) -> None:
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8")
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def create_database(self, name: str) -> str:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, name)
        return self.url(name)

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL Prefect takes as PREFECT_API_DATABASE_CONNECTION_URL."""
        return f"postgresql+asyncpg://{USER}@127.0.0.1:{self.port}/{database}"

    def _stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
