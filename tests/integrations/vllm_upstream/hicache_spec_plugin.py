"""A pytest plugin that runs vLLM's own tests of out-of-tree offloading specs against
HiCacheOffloadingSpec (`make test-vllm-upstream` loads it with -p, over the test files it
extracts from the vLLM sdist).

vLLM's tests define stand-in specs of their own (STANDINS). The plugin puts hicache's class
in their place in the test module's namespace, so that vLLM's OffloadingSpecFactory, which
looks the class up as getattr(import_module(spec_module_path), spec_name), and the tests'
own isinstance checks both get hicache's spec. Each test in ON_HICACHE_SPEC must build one.

The run fails, rather than passes quietly, when a stand-in or a test named here no longer
exists in vLLM's files, when a test is skipped (deselect it by name here instead, with the
reason), or when a test in ON_HICACHE_SPEC built no HiCacheOffloadingSpec.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hicache.integrations.vllm import HiCacheOffloadingSpec

FACTORY = "tests/v1/kv_offload/test_factory.py"
WORKER = "tests/v1/kv_connector/unit/offloading_connector/test_worker.py"

# test module -> the names of its stand-in specs, each replaced by HiCacheOffloadingSpec
STANDINS = {
    "tests.v1.kv_offload.test_factory": ("SingleArgExternalOffloadingSpec",),
    "tests.v1.kv_connector.unit.offloading_connector.test_worker": ("BareExternalOffloadingSpec",),
}

# the tests that build a stand-in: with this plugin, hicache's spec
ON_HICACHE_SPEC = (
    # vLLM's factory loads the spec through spec_module_path + spec_name and passes the config
    f"{FACTORY}::test_create_dynamic_spec_receives_config",
    f"{FACTORY}::test_offloading_spec_has_replicated_layout_default",
    # vLLM's OffloadingConnectorWorker takes the out-of-tree spec (rank 1, default layout)
    f"{WORKER}::test_offloading_connector_worker_accepts_plugin_spec_default_layout",
)

# Tests that cannot pass on a CPU-only machine, each with the reason.
DESELECTED: dict[str, str] = {
    # vLLM parametrizes these over the GPU attention backends of the platform (ATTN_BACKENDS):
    # none on CPU, so pytest would only report an empty parameter set as skipped.
    f"{WORKER}::test_register_kv_caches": "parametrized over GPU attention backends: none on CPU",
    f"{WORKER}::test_register_kv_caches_uniform_type": "parametrized over GPU attention backends: none on CPU",
}


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"hicache: vLLM's stand-in specs replaced by {HiCacheOffloadingSpec.__module__}.HiCacheOffloadingSpec"]


@pytest.hookimpl(tryfirst=True)  # before -k/-m, so that a name missing from vLLM's files is always seen
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def base(item: pytest.Item) -> str:
        return item.nodeid.split("[")[0]

    names = {base(item) for item in items}
    missing = sorted(n for n in (*DESELECTED, *ON_HICACHE_SPEC) if n not in names)
    if missing:
        raise pytest.UsageError(f"not among vLLM's collected tests (renamed upstream?): {missing}")
    dropped = [item for item in items if base(item) in DESELECTED]
    items[:] = [item for item in items if base(item) not in DESELECTED]
    config.hook.pytest_deselected(items=dropped)


@pytest.fixture(autouse=True)
def _hicache_spec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in STANDINS.get(request.module.__name__, ()):
        monkeypatch.setattr(request.module, name, HiCacheOffloadingSpec)  # raises if vLLM dropped the name
    built: list[HiCacheOffloadingSpec] = []
    init = HiCacheOffloadingSpec.__init__

    def counting_init(self: HiCacheOffloadingSpec, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(HiCacheOffloadingSpec, "__init__", counting_init)
    yield
    if request.node.nodeid in ON_HICACHE_SPEC:
        assert built, f"{request.node.nodeid} built no HiCacheOffloadingSpec: it no longer takes a stand-in spec"


_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for name, reason in DESELECTED.items():
        terminalreporter.write_line(f"deselected (cannot pass on CPU): {name}: {reason}")
    for name in _skipped:
        terminalreporter.write_line(f"FAILED (skipped; deselect it in {__name__} with the reason): {name}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and exitstatus == 0:
        session.exitstatus = 1
