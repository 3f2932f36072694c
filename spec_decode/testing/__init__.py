"""Test aids shipped with the library: NaN fault injection (``faults``) and a real fp16 overflow (``overflow``)."""
