"""Test aids shipped with the library: a real fp16 overflow (``overflow``). NaN fault injection is a runtime
argument of ``generate`` and lives beside the decoder (``spec_decode.faults``)."""
