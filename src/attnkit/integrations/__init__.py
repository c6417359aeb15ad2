"""Adapters that plug attnkit into other libraries.

- :mod:`attnkit.integrations.transformers`: Hugging Face transformers models with
  ``attn_implementation="attnkit"`` (needs ``pip install 'attnkit[transformers]'``).

Each adapter imports its library only when the adapter itself is imported.
"""
