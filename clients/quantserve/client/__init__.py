"""The quantserve client (the quantserve-client distribution, clients/). Never imports torch: a user runs it on
a laptop against a remote server.

``Client`` / ``AsyncClient`` talk gRPC (default) or HTTP (``http=True``) and return the typed results below;
every failure is a ``ClientError`` with a transport-independent ``code``. ``quant-client`` (quantserve.client.cli) is
the command line on top. Plotting (quantserve.client.plot) needs matplotlib, imported only when a plot is drawn.
"""

from quantserve.client.client import AsyncClient, Client, default_target, make_sampling
from quantserve.client.errors import EXIT_CODES, ClientError
from quantserve.client.metrics import CellMetrics, cell_metrics, distinct_n, repetition_rate
from quantserve.client.types import (Alternative, Candidate, EngineMemory, MemoryAccounting, Message, ModelInfo,
                                     Options, Plan, Refusal, Request, RequestShape, Result, Sampling, ShapePlan,
                                     StreamChunk, TokenLogprob, Tokens, TraceStep, Usage, to_dict)

__all__ = [
    "AsyncClient", "Client", "ClientError", "EXIT_CODES", "default_target", "make_sampling",
    "Alternative", "Candidate", "EngineMemory", "MemoryAccounting", "Message", "ModelInfo", "Options", "Request",
    "Result", "Sampling", "StreamChunk", "TokenLogprob", "Tokens", "TraceStep", "Usage", "to_dict",
    "Plan", "RequestShape", "ShapePlan", "Refusal",
    "CellMetrics", "cell_metrics", "distinct_n", "repetition_rate",
]
