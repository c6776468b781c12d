"""Integrations of fullcg with other libraries, each imported only when used.

- :mod:`fullcg.integrations.transformers`: Hugging Face ``transformers`` causal LMs with
  ``attn_implementation="fullcg"`` (needs ``pip install fullcg[transformers]``).
"""
