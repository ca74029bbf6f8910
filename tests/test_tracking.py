"""MLflow store helpers on a real sqlite store: the experiment-type tag, the runs-page address `make ui` prints."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.runs.store import tracking, ui_pages
from pipeline.utils.paths import PROJECT_ROOT


@pytest.fixture()
def store(tmp_path: Path) -> dict:
    uri = f"sqlite:///{(tmp_path / 'mlflow.db').as_posix()}"
    return {"uri": uri, "client": MlflowClient(tracking_uri=uri), "artifacts": tmp_path / "mlartifacts"}


def test_new_experiment_carries_the_model_training_kind(store) -> None:
    client = store["client"]
    experiment_id = tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client)
    experiment = client.get_experiment(experiment_id)
    assert experiment.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert experiment.artifact_location == store["artifacts"].resolve().as_uri()


def test_older_experiment_gets_the_tag_and_a_chosen_kind_is_kept(store) -> None:
    client = store["client"]
    old = client.create_experiment("pain-cv", artifact_location=store["artifacts"].resolve().as_uri())
    assert tracking.EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags
    assert tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client) == old
    assert client.get_experiment(old).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"

    chosen = client.create_experiment("someone-else", tags={tracking.EXPERIMENT_KIND_TAG: "genai_development"})
    assert tracking.get_or_create_experiment("someone-else", store["artifacts"], client=client) == chosen
    assert client.get_experiment(chosen).tags[tracking.EXPERIMENT_KIND_TAG] == "genai_development"

    client.delete_experiment(old)
    assert tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client) == old
    assert client.get_experiment(old).lifecycle_stage == "active"


def test_find_experiment_id_reads_the_store_by_name(store, tmp_path: Path) -> None:
    client = store["client"]
    other = tracking.get_or_create_experiment("other", store["artifacts"], client=client)
    pain = tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client)
    assert other != pain
    assert ui_pages.find_experiment_id(store["uri"]) == pain
    assert ui_pages.find_experiment_id(store["uri"], "other") == other
    assert ui_pages.find_experiment_id(store["uri"], "absent") is None
    client.delete_experiment(other)
    assert ui_pages.find_experiment_id(store["uri"], "other") is None
    missing = tmp_path / "nowhere" / "mlflow.db"
    assert ui_pages.find_experiment_id(f"sqlite:///{missing}") is None
    assert not missing.parent.exists(), "looking up an address must not create a store"


def test_ui_url_opens_the_runs_table_in_model_training_mode() -> None:
    assert ui_pages.ui_url("127.0.0.1", 5000, "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning")
    assert ui_pages.ui_url("127.0.0.1", "5001", None) == "http://127.0.0.1:5001/#/experiments?workflowType=machine_learning"


def test_make_ui_asks_for_a_password_made_for_it(store, tmp_path: Path) -> None:
    """`make ui` over a sqlite store: it prints the runs page's address and where the password is (a file only this
    user can read, in a 0700 folder); the UI answers 401 without it and 200 with it; no command line of its
    processes holds the password or the store; the file goes when the UI stops (Ctrl+C), also where it was started
    with SIGINT ignored."""
    import re
    import signal
    import socket
    import stat
    import time
    import urllib.error
    import urllib.request

    from pipeline.runs.store.private_server import free_port
    from pipeline.runs.store.tracking_server import auth_call
    from pipeline.utils.processes import stop_process_group

    experiment_id = tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=store["client"])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_AUTH", "MLFLOW_TRACKING"))}
    env.update({"MLFLOW_TRACKING_URI": store["uri"], "PYTHONPATH": str(PROJECT_ROOT)})
    out = tmp_path / "ui.out"
    with out.open("w") as log:
        # started as a script's background job is (SIGINT ignored, which Python would keep): Ctrl+C must still stop it
        ui = subprocess.Popen(["make", "--no-print-directory", "-o", ".venv/.installed", "ui", f"MLFLOW_PORT={port}"],
                              cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 180
        while "password in" not in out.read_text():
            assert ui.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        printed = out.read_text()
        assert f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs?workflowType=machine_learning" in printed
        secret = Path(re.search(r"password in (\S+) \(", printed).group(1))
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
        password = secret.read_text().strip()
        assert password not in printed
        search = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1"
        try:
            urllib.request.urlopen(search, timeout=10)
            raise AssertionError("the UI answered without a password")
        except urllib.error.HTTPError as error:
            assert error.code == 401
        assert auth_call(f"http://127.0.0.1:{port}", "/api/2.0/mlflow/experiments/search", "admin", password,
                         query={"max_results": 1})[0] == 200
        page = urllib.request.Request(f"http://127.0.0.1:{port}/", headers=_basic(password))
        with urllib.request.urlopen(page, timeout=10) as answer:  # what the browser gets once logged in
            assert b"MLflow" in answer.read()
        lines = [_command_line(pid) for pid in os.listdir("/proc") if pid.isdigit()]  # every process's, as ps
        assert any(b"mlflow\0server" in line and f"--port\0{port}\0".encode() in line for line in lines)
        assert not [line for line in lines if password.encode() in line or str(tmp_path).encode() in line]
        os.killpg(ui.pid, signal.SIGINT)  # Ctrl+C (it may take over a minute to stop on a loaded machine)
        assert ui.wait(timeout=180) in (0, 2, 130, -signal.SIGINT), out.read_text()[-2000:]  # make: killed by it
        assert not secret.exists() and not secret.parent.exists()
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # the server went with it
    finally:
        stop_process_group(ui, grace_s=10)


def _basic(password: str) -> dict[str, str]:
    import base64

    return {"Authorization": "Basic " + base64.b64encode(f"admin:{password}".encode()).decode()}


def _command_line(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def test_ui_url_answers_without_mlflow(store) -> None:
    """`python -m pipeline ui-url` (what a script may ask for the address): quick, no mlflow nor torch import."""
    experiment_id = tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=store["client"])
    env = {**os.environ, "MLFLOW_TRACKING_URI": store["uri"]}
    probe = "import sys; from pipeline.cli import main; main(sys.argv[1:]); " \
            "print('mlflow imported' if {'mlflow', 'torch'} & set(sys.modules) else 'mlflow not imported')"
    printed = subprocess.run([sys.executable, "-c", probe, "ui-url", "--port", "5123"], cwd=PROJECT_ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert f"http://127.0.0.1:5123/#/experiments/{experiment_id}/runs?workflowType=machine_learning" in printed.stdout
    assert "mlflow not imported" in printed.stdout


class LeaseTakenOver(RuntimeError):
    """Stands for `fold_lease.LeaseLost`: an error that ends a run KILLED, without a traceback."""


def test_a_run_ends_finished_killed_or_failed_with_its_traceback(store) -> None:
    """`tracking.run_lifecycle`, the one life of every run a command opens: FINISHED when the block returns, FAILED
    with traceback.txt on an error, KILLED on Ctrl-C or on a `stopped` error (no traceback), a run the block ends
    itself left as it is; the active run (`mlflow.start_run`) ended through MLflow, so the next one can start."""
    import mlflow

    client = store["client"]
    experiment_id = tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client)

    def ended(block, **options) -> tuple[str, list[str]]:
        run_id = client.create_run(experiment_id).info.run_id
        with pytest.raises(BaseException) if block is not None else contextlib.nullcontext():
            with tracking.run_lifecycle(run_id, client, **options):
                if block is not None:
                    raise block
        return client.get_run(run_id).info.status, [a.path for a in client.list_artifacts(run_id)]

    assert ended(None) == (tracking.FINISHED, [])
    assert ended(ValueError("a bad fold")) == (tracking.FAILED, ["traceback.txt"])
    assert ended(KeyboardInterrupt()) == (tracking.KILLED, ["traceback.txt"])
    assert ended(LeaseTakenOver(), stopped=(LeaseTakenOver,)) == (tracking.KILLED, [])
    assert ended(None, finish=False)[0] == tracking.RUNNING
    mlflow.set_tracking_uri(store["uri"])
    for attempt in range(2):  # the active run is ended, so the next one can start
        active = mlflow.start_run(experiment_id=experiment_id)
        with pytest.raises(ValueError), tracking.run_lifecycle(active.info.run_id, client):
            raise ValueError(f"attempt {attempt}")
        assert mlflow.active_run() is None and client.get_run(active.info.run_id).info.status == tracking.FAILED


def test_the_headline_view_is_a_saved_view_that_make_ui_opens(store) -> None:
    """`set_headline_view` writes the UI's saved view (name, state with the columns in order and wide enough for their
    headers), only when it changes, and grows it on `add`; `ui-url` then prints the runs address on that view and,
    once the comparisons' experiment exists, its address too, still without importing mlflow."""
    client = store["client"]
    cv = tracking.get_or_create_experiment("view-cv", store["artifacts"], client=client)
    assert not ui_pages.has_headline_view(store["uri"], cv)
    columns = [tracking.DURATION_COLUMN, ui_pages.metric_column("video_auroc"), ui_pages.metric_column("accuracy")]
    ui_pages.set_headline_view(client, cv, columns)
    key = tracking.SHARED_VIEW_TAG_PREFIX + tracking.HEADLINE_VIEW
    written = client.get_experiment(cv).tags[key]
    envelope = json.loads(written)
    state = json.loads(envelope["state"])
    assert envelope["name"] == tracking.HEADLINE_VIEW_NAME and envelope["createdAt"] <= envelope["updatedAt"]
    assert state["selectedColumns"] == columns and state["columnOrder"] == [tracking.RUN_NAME_COLUMN, *columns]
    assert state["columnWidths"]["metrics.`video_auroc`"] >= 7 * len("video_auroc")
    ui_pages.set_headline_view(client, cv, columns)
    assert client.get_experiment(cv).tags[key] == written  # unchanged: not written again
    ui_pages.set_headline_view(client, cv, [ui_pages.metric_column("a-b/diff")], add=True)
    grown = json.loads(json.loads(client.get_experiment(cv).tags[key])["state"])["selectedColumns"]
    assert grown == [*columns, "metrics.`a-b/diff`"]
    assert ui_pages.has_headline_view(store["uri"], cv)

    comparisons = tracking.get_or_create_experiment(ui_pages.comparisons_experiment("view-cv"), store["artifacts"],
                                                    client=client)
    env = {**os.environ, "MLFLOW_TRACKING_URI": store["uri"]}
    probe = "import sys; from pipeline.cli import main; main(sys.argv[1:]); " \
            "print('mlflow imported' if {'mlflow', 'torch'} & set(sys.modules) else 'mlflow not imported')"
    printed = subprocess.run([sys.executable, "-c", probe, "ui-url", "--port", "5123", "--experiment", "view-cv"],
                             cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert (f"http://127.0.0.1:5123/#/experiments/{cv}/runs?workflowType=machine_learning&viewStateShareKey=headline"
            in printed.stdout)
    assert (f"Comparisons (make compare): http://127.0.0.1:5123/#/experiments/{comparisons}/runs?workflowType="
            f"machine_learning\n" in printed.stdout)  # no view there yet: no key that the UI would not find
    assert "mlflow not imported" in printed.stdout
