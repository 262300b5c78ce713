"""The simulated CS-2 fabric: CSR execution of masked layers and a weight-streaming cost model.

    model = simulator.compile(model, algorithm=alg)    # masked nn.Linear -> CSRLinear
    simulator.decisions(model)                          # kernel per layer, and why
    proj = simulator.project_step(simulator.layers_from_model(model, seq_tokens=2048),
                                  tokens=524288, cluster=simulator.WaferScaleCluster(4))
"""

from simulator.cost_model import (CS2, CostKnobs, LayerProjection, LayerShape, StepProjection,
                                  WaferScaleCluster, gpt_layer_shapes, layers_from_model,
                                  project_step)
from simulator.csr import CSRStructure, csr_linear
from simulator.layers import CSRLinear, LayerDecision, decisions
from simulator.layers import compile_model as compile  # the name: simulator.compile

__all__ = [
    "CS2", "CSRLinear", "CSRStructure", "CostKnobs", "LayerDecision", "LayerProjection",
    "LayerShape", "StepProjection", "WaferScaleCluster", "compile", "csr_linear", "decisions",
    "gpt_layer_shapes", "layers_from_model", "project_step",
]
