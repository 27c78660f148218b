"""The start-up heap frozen out of full garbage collections (runtime/gc_heap.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import weakref
from pathlib import Path


class _Node:
    pass


def _cycle() -> tuple[_Node, weakref.ref]:
    node = _Node()
    node.self = node
    return node, weakref.ref(node)


def test_freezing_collects_first_then_keeps_frozen_cycles_until_unfrozen():
    # Run apart: freezing is process-wide, and this test must not change the suite's process.
    script = """
        import gc, weakref
        from conveyor.runtime.gc_heap import freeze_startup_heap, unfreeze_heap
        from tests.runtime.test_gc_heap import _cycle

        garbage, garbage_ref = _cycle()
        del garbage  # unreachable already: the collection before freezing frees it
        kept, kept_ref = _cycle()
        frozen = freeze_startup_heap()
        assert garbage_ref() is None
        assert frozen == gc.get_freeze_count() > 1000
        assert not any(o is kept for o in gc.get_objects())  # frozen: collections skip it
        del kept
        gc.collect()
        assert kept_ref() is not None  # a frozen cycle outlives collections...
        later, later_ref = _cycle()
        del later
        gc.collect()
        assert later_ref() is None  # ...while what serving allocates is collected as ever
        unfreeze_heap()
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert kept_ref() is None  # given back, the old cycle is freed
        print("ok")
        """
    _run(script)


def _run(script: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=Path(__file__).resolve().parents[2],  # the tests package is importable from here
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr


def test_a_worker_freezes_once_its_cache_is_in_place():
    _run(
        """
        import gc
        from conveyor.protocol.worker_messages import InitializeCache
        from conveyor.worker.worker_process import handle_command

        class Worker:
            def initialize_cache(self, num_blocks):
                self.num_blocks = num_blocks

        assert gc.get_freeze_count() == 0
        reply = handle_command(Worker(), 0, InitializeCache(num_blocks=8), faults=None)
        assert type(reply).__name__ == "CacheReady" and gc.get_freeze_count() > 1000
        print("ok")
        """
    )


def test_an_llm_freezes_its_process_heap_and_gives_it_back_at_shutdown(tiny_model_dir):
    _run(
        f"""
        import gc
        from conveyor.frontend import LLM
        from conveyor.protocol import SamplingParams

        llm = LLM({str(tiny_model_dir)!r}, engine="inprocess", kv_cache_memory=16 << 20)
        assert gc.get_freeze_count() > 1000
        model = llm._engine  # start-up state: frozen, so full collections do not walk it
        assert not any(o is model for o in gc.get_objects())
        params = SamplingParams(temperature=0, max_tokens=4)
        assert len(llm.generate(["def main():"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        llm.shutdown()
        assert gc.get_freeze_count() == 0
        print("ok")
        """
    )
