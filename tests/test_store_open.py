"""A new sqlite store opened by several processes at the same moment: created and migrated once, under the lock
beside it (`pipeline.runs.store.tracking.open_store`), and every process goes on with it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from mlflow import MlflowClient

from pipeline.runs.store import tracking
from pipeline.utils.paths import PROJECT_ROOT

# One process as a command opens the store: the tracking URI through store_uri, then a read and a write. Each says
# it is ready once its imports are done, then waits for the go file, so that all open the store in the same moment.
OPENER = """
import sys, time
from pathlib import Path
from mlflow import MlflowClient
from pipeline.runs.store import tracking
uri, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ready.write_text("ready")
while not go.exists():
    time.sleep(0.001)
client = MlflowClient(tracking.store_uri(uri))
client.search_experiments()
tracking.get_or_create_experiment("pain-cv", Path(uri.removeprefix("sqlite:///")).parent / "art", client=client)
print("opened")
"""


def test_processes_opening_a_fresh_sqlite_store_at_once_all_succeed(tmp_path: Path) -> None:
    """Three fresh stores, two processes each, all six released together: without the lock one process of a pair
    stops with MLflow's migration race (`table _alembic_tmp_... already exists`, a duplicate column)."""
    stores = [tmp_path / f"store_{n}" / "mlflow.db" for n in range(3)]
    go = tmp_path / "go"
    started = []
    for database in stores:
        for name in ("a", "b"):
            ready = database.parent / f"ready_{name}"
            database.parent.mkdir(exist_ok=True)
            process = subprocess.Popen([sys.executable, "-c", OPENER, f"sqlite:///{database}", str(ready), str(go)],
                                       cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            started.append((process, ready))
    deadline = time.monotonic() + 300  # a bound for a broken test, not a wait of its own
    while not all(ready.exists() for _, ready in started):
        assert all(process.poll() is None for process, _ in started), [p.communicate()[0] for p, _ in started]
        assert time.monotonic() < deadline, "the openers never got ready"
        time.sleep(0.05)
    go.write_text("go")
    outputs = [process.communicate(timeout=300)[0] for process, _ in started]
    for (process, _), output in zip(started, outputs, strict=True):
        assert process.returncode == 0 and "opened" in output, output[-3000:]
    for database in stores:
        assert database.with_name("mlflow.db.lock").is_file()  # the lock lies beside the store
        client = MlflowClient(f"sqlite:///{database}")
        assert [e.name for e in client.search_experiments() if e.name == "pain-cv"] == ["pain-cv"]


def test_a_server_uri_is_left_to_its_server_and_an_open_store_is_opened_once(tmp_path: Path) -> None:
    assert tracking.open_store("http://127.0.0.1:1") == "http://127.0.0.1:1"  # nothing asked of a server here
    database = tmp_path / "nested" / "mlflow.db"
    uri = f"sqlite:///{database}"
    assert tracking.open_store(uri) == uri
    assert database.is_file() and database.with_name("mlflow.db.lock").is_file()
    assert MlflowClient(uri).search_experiments()  # complete: MLflow's Default experiment is there
