"""Worker-side helper for the EAGLE-3 tests: switch a loaded generator from speculators' capturing forward to
vLLM's own forward with EAGLE-3 auxiliary outputs (SupportsEagle3), feeding them into the same bookkeeping.

Sent to vLLM's worker processes by value (cloudpickle) through ``executor.collective_rpc(callable)``.
"""

from __future__ import annotations


def use_vllm_eagle3_aux(worker, aux_layer_ids: tuple[int, ...]) -> str:
    """Make the worker's model return vLLM's EAGLE-3 aux states (inputs of ``aux_layer_ids``) as the captures."""
    import types

    model = worker.model_runner.model
    language_model = model.get_language_model() if hasattr(model, "get_language_model") else model
    language_model.model.__dict__.pop("forward", None)  # drop speculators' capturing forward
    model.set_aux_hidden_state_layers(tuple(aux_layer_ids))  # SupportsEagle3 (vLLM patch 0001/0002)
    original = type(model).forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if isinstance(out, tuple):
            hidden, aux = out
            worker._store_captured_states([a.clone() for a in aux])
            return hidden
        raise RuntimeError("model returned no EAGLE-3 aux hidden states")

    model.forward = types.MethodType(forward, model)
    return type(model).__name__
