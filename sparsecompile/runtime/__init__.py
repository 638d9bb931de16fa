"""The KV core (floor 1): model-agnostic, no HF class.

The method contract (``contract.py``: SparseMethod, LayerContext, PrefillMode) and the model facts it needs
(``model_info.py``); the SparseController that drives a method's lifecycle (``controller.py``, its decode steps
``decode_unit.py``); the paged pool (``cache_manager.py``, ``block_tables.py``, ``allocator.py``), views
(``view.py``), per-forward state (``step.py``), capacity (``memory_oracle.py``), statistics (``stats.py``) and
compile settings (``compilation.py``).
Imports only ``kernels/`` and ``config.py`` below it.
"""
