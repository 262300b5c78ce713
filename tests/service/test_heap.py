"""service/heap.py: rarer collections, and what is alive after late imports frozen, so full
collections stay short."""

import json
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
