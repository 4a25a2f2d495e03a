"""DeadPool-Megatron: hot-swap fault tolerance for Megatron-Core training.

Importing the package has no side effects; megatron.core is imported lazily by the modules
that need it, after `deadpool_megatron.rehearsal.prepare_megatron_import()` where required.
"""

__version__ = "0.1.0"
