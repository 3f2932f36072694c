"""Plugins that carry safespec into other programs: SGLang (``sglang_plugin``) and pytest (``pytest_plugin``).

Importing this package imports nothing: pytest loads ``pytest_plugin`` in every run where safespec is
installed, and it must stay free of torch until a fixture is used.
"""
