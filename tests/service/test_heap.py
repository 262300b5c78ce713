"""service/heap.py: rarer collections, and what is alive after late imports frozen, so full
collections stay short."""

import gc
import json
import os
import subprocess
import sys
import textwrap

from service import heap

PROBE = textwrap.dedent("""
    import gc, json, sys
    from service import heap

    heap.tune_collection()
    heap.tune_collection()  # once per process, however often called
    counts = {"callbacks": sum(cb is heap._after_collection for cb in gc.callbacks),
              "thresholds": list(gc.get_threshold())}
    gc.collect()
    counts["after_startup"] = gc.get_freeze_count()
    import sqlalchemy.orm  # a late import: hundreds of modules
    import_objects = len(gc.get_objects())
    gc.collect()
    counts["after_import"] = gc.get_freeze_count()
    counts["tracked_after_import"] = len(gc.get_objects())
    garbage = [[] for _ in range(1000)]
    for item in garbage:
        item.append(item)  # cyclic garbage made after the freeze is still collected
    del garbage, item
    counts["collected"] = gc.collect()
    counts["after_no_import"] = gc.get_freeze_count()
    counts["import_objects"] = import_objects
    print(json.dumps(counts))
""")


def test_a_full_collection_after_new_imports_freezes_what_is_alive_and_later_garbage_is_freed():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout
    counts = json.loads(out)
    assert counts["callbacks"] == 1
    assert tuple(counts["thresholds"]) == heap.THRESHOLDS
    assert counts["after_startup"] > 0  # the first full pass freezes the startup heap
    # The import's objects are out of later passes: they walk a fraction of the heap.
    assert counts["after_import"] > counts["after_startup"] + 10_000
    assert counts["tracked_after_import"] < counts["import_objects"] / 10
    assert counts["collected"] >= 1000
    assert counts["after_no_import"] == counts["after_import"]  # no new modules: no freeze


def test_the_servers_app_tunes_the_collector_and_a_tests_app_leaves_it(client, tmp_path):
    # `client` runs create_app()'s lifespan in this process: nothing changed here.
    assert gc.get_threshold() != heap.THRESHOLDS and heap._after_collection not in gc.callbacks
    probe = textwrap.dedent("""
        import gc
        from fastapi.testclient import TestClient
        from service.main import app  # what `uvicorn service.main:app` serves
        from service import heap

        with TestClient(app):
            print(gc.get_threshold() == heap.THRESHOLDS, heap._after_collection in gc.callbacks)
    """)
    env = {**os.environ, "CSX_DATABASE_URL": f"sqlite:///{tmp_path / 'csx.db'}",
           "CSX_RUNS_DIR": str(tmp_path / "runs"),
           "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         check=True, timeout=300).stdout
    assert out.split() == ["True", "True"]
