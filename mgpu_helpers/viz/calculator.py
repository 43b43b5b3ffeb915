"""Chapter 14's calculator: sliders over :func:`mgpu_helpers.planning.planner.predict`."""

from __future__ import annotations

from ..planning import planner

MODELS = {model.name: model for model in planner.PUBLISHED}


def settings_prediction(model: str, nodes: int, tp: int, pp: int, cp: int, zero: int,
                        micro_batch: int, global_batch: int, length: int,
                        checkpointing: bool, ep: int = 1,
                        cluster: planner.Cluster = planner.H100_NODES):
    """The plan the sliders describe (dp is what the GPUs leave) and its prediction, or
    the reason there is none (a string)."""
    gpus = nodes * cluster.gpus_per_node
    if gpus % (tp * pp * cp):
        return None, f"{gpus} GPUs do not split into tp x pp x cp = {tp * pp * cp}"
    dp = gpus // (tp * pp * cp)
    if global_batch % (dp * micro_batch):
        return None, (f"a global batch of {global_batch} sequences does not split into "
                      f"dp {dp} x micro-batches of {micro_batch}")
    try:
        plan = planner.Plan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero,
                            micro_batch=micro_batch,
                            micro_batches=global_batch // (dp * micro_batch),
                            checkpointing=checkpointing)
        return plan, planner.predict(MODELS[model], cluster, plan, length)
    except ValueError as refusal:
        return None, str(refusal)


def calculator(**start):
    """Sliders for the model, nodes of 8 H100s, the degrees (ep for the mixture of
    experts), ZeRO's stage, the batch and recomputation; prints
    :func:`planner.format_prediction` as they move. ``start`` overrides the sliders'
    first values. Returns the ``interactive`` panel."""
    import ipywidgets as widgets
    from IPython.display import display

    powers = [1, 2, 4, 8, 16, 32, 64]
    controls = {
        "model": widgets.Dropdown(options=list(MODELS), value="Llama 3 70B"),
        "nodes": widgets.SelectionSlider(options=powers + [128, 256], value=8),
        "tp": widgets.SelectionSlider(options=powers[:4], value=8),
        "pp": widgets.SelectionSlider(options=powers, value=1),
        "cp": widgets.SelectionSlider(options=powers, value=1),
        "ep": widgets.SelectionSlider(options=powers[:4], value=1),
        "zero": widgets.IntSlider(3, min=0, max=3),
        "micro_batch": widgets.SelectionSlider(options=powers[:5], value=1),
        "global_batch": widgets.SelectionSlider(options=[2**k for k in range(4, 13)],
                                                value=256),
        "length": widgets.SelectionSlider(options=[2**k for k in range(10, 18)], value=4096),
        "checkpointing": widgets.Checkbox(False, description="recompute"),
    }
    for name, value in start.items():
        controls[name].value = value

    def show(**settings):
        plan, prediction = settings_prediction(**settings)
        print(planner.format_prediction(prediction, plan) if plan else f"no plan: {prediction}")

    panel = widgets.interactive(show, **controls)
    display(panel)
    return panel
