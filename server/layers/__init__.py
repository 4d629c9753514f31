"""Shared layers the model definitions (``server.models``) are built from: projections (``linear``: any
scheme's runtime module, fused groups, accounting), RMSNorm incl. Gemma's (1 + w) (``norm``), rotary embedding
with the rope-scaling types (``rotary``), the gated MLP (``mlp``). The glue arithmetic runs as the fused CPU
ops of ``server.fastops`` or their eager references; attention is ``server.attention``'s.
"""
