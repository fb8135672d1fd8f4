"""Start an MLflow server on 127.0.0.1 over a project's tracking store (``rayjobs ui``).

    rayjobs ui [--storage-path results] [--port 5000] [--auth]

With ``--auth`` the server runs MLflow's basic-auth app; the admin account comes from
MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, the same variables clients log with.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rayjobs.errors import ConfigError
from rayjobs.mlflow_store import seed
from rayjobs.rundir import mlflow_db

JOB_EXECUTION_VARIABLE = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def server_command(
    store_dir: str, port: int, host: str = "127.0.0.1", auth: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The ``mlflow server`` command line and environment for a store directory."""
    store = Path(store_dir).resolve()
    store.mkdir(parents=True, exist_ok=True)
    seed(mlflow_db(store))
    cmd = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{mlflow_db(store)}",
        "--artifacts-destination",
        str(store / "mlartifacts"),
        "--workers",
        "1",
    ]
    env = dict(os.environ)
    # MLflow 3 starts a job runner and seven huey consumers beside the server, for its GenAI jobs
    # (prompt optimization, scorers, trace roll-ups), which rayjobs never submits: each is a Python
    # with mlflow imported. Off unless you turn it on.
    env.setdefault(JOB_EXECUTION_VARIABLE, "false")
    if auth:
        user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if not user or not password:
            raise ConfigError(
                "ui --auth: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (the admin account)"
            )
        ini = store / "basic_auth.ini"
        private_file(ini).write_text(
            "[mlflow]\ndefault_permission = READ\n"
            f"database_uri = sqlite:///{store / 'basic_auth.db'}\n"
            f"admin_username = {user}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            "auth_cache_ttl_seconds = 60\n"  # one PBKDF2 check per minute per user, not per request
        )
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(ini)
        env["MLFLOW_AUTH_ADMIN_PASSWORD"] = password
        # CSRF protection needs a stable secret; keep one beside the store (made once, private).
        secret = store / ".flask_secret"
        if not secret.exists():
            import secrets

            private_file(secret).write_text(secrets.token_hex(32))
        note = rotate_admin_password(store / "basic_auth.db", user, password)
        if "rotated" in note:
            print(f"rayjobs: ui --auth: {note}", flush=True)
        env.setdefault("MLFLOW_FLASK_SERVER_SECRET_KEY", secret.read_text().strip())
        cmd += ["--app-name", "basic-auth"]
    return cmd, env


def private_file(path: Path) -> Path:
    """Create ``path`` readable by its owner only, before anything is written into it."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)  # an older file made with wider bits
    return path


def rotate_admin_password(db: Path, user: str, password: str) -> str:
    """Make the admin account of an existing auth store use ``password``: what happened, in words.

    MLflow sets the admin password only when it creates the store; a changed
    MLFLOW_TRACKING_PASSWORD would otherwise be ignored silently.
    """
    if not db.exists():
        return "new store: the server creates the admin account"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MLflow's server modules warn about their own dependencies on import
        from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    auth = SqlAlchemyStore()
    auth.init_db(f"sqlite:///{db}")
    if not auth.has_user(user):
        raise ConfigError(
            f"ui --auth: {db} has no user {user!r} (MLFLOW_TRACKING_USERNAME); use the admin it was made with, "
            "or remove that file to start a new auth store"
        )
    if auth.authenticate_user(user, password):
        return "admin password unchanged"
    try:
        auth.update_user(user, password=password)
    except Exception as exc:  # noqa: BLE001 - MLflow's password rules
        raise ConfigError(f"ui --auth: cannot set the admin password: {exc}") from None
    return "admin password rotated to MLFLOW_TRACKING_PASSWORD"


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on ``host:port``."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def wait_until_up(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url/health`` until the server answers (any HTTP status counts as up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"mlflow server at {url} did not answer within {timeout:.0f} s")


def start(store_dir: str, port: int, auth: bool = False, log_path: str | None = None) -> subprocess.Popen:
    """Start the server in the background and wait until it answers.

    A server that exits first is a ConfigError naming its own last error line (a weak password, a
    store it cannot open), read from its log (``log_path``, else ``<store>/server.log``).
    """
    cmd, env = server_command(store_dir, port, auth=auth)
    log = Path(log_path) if log_path else Path(store_dir).resolve() / "server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(f"http://127.0.0.1:{port}", proc=proc)
    except RuntimeError:
        errors = [
            line for line in log.read_text(errors="replace").splitlines() if "Exception: " in line or "Error: " in line
        ]
        reason = errors[-1].split(": ", 1)[-1] if errors else f"exit status {proc.returncode}"
        raise ConfigError(f"ui: the MLflow server did not start: {reason} (its log: {log})") from None
    except BaseException:  # Ctrl-C while it started: it is in a session of its own, so nothing else stops it
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Stop a server started by ``start``: its whole process group (uvicorn has children), SIGTERM
    first, then SIGKILL for whatever is left (a worker that outlived its leader, or a slow exit).

    Its descendants are also killed by pid, found while the leader still lives: one that left the
    group (MLflow 3's uvicorn and huey workers) would otherwise outlive the server, reparented."""
    import signal

    import psutil

    family = _family(proc.pid)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    family += _family(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while any member lives
    except (ProcessLookupError, PermissionError):
        pass
    for member in family:
        try:
            member.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=15)
    if proc.poll() is None:
        proc.wait(timeout=15)


def _family(pid: int) -> list[Any]:
    """The process ``pid`` and its descendants now (psutil processes; none when it is gone)."""
    import psutil

    try:
        leader = psutil.Process(pid)
        return [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return []


def serve(store_dir: str, port: int, auth: bool) -> None:
    """``rayjobs ui``: run the server in the foreground until Ctrl-C, SIGTERM or SIGHUP (which stop it too)."""
    import signal

    if port_in_use(port):
        print(
            f"rayjobs: error: ui: port {port} on 127.0.0.1 is in use; stop what listens there or give --port",
            file=sys.stderr,
        )
        sys.exit(1)
    fresh = not os.path.exists(mlflow_db(str(Path(store_dir).resolve())))

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)  # before the server starts: `start` stops it when interrupted
    signal.signal(signal.SIGHUP, _stop)
    try:
        proc = start(store_dir, port, auth=auth)
    except KeyboardInterrupt:
        return
    try:  # from here on a signal at any point (even during the print) still stops the server
        print(f"MLflow UI: http://127.0.0.1:{port}  (store: {Path(store_dir).resolve()}; Ctrl-C stops it)", flush=True)
        if fresh:  # a mistyped --storage-path showed an empty UI without a word
            print(
                f"rayjobs: no runs there yet: a new, empty store; runs land in it with --set run.storage_path={store_dir} "
                f"or --set tracking.uri=http://127.0.0.1:{port}",
                flush=True,
            )
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop(proc)
