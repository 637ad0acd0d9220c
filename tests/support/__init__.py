"""Helpers shared by the tests (no tests here): a coordinator in a thread (`coordinator`), a fleet of processes
(`fleet`), tiny models (`models`, `quadratic`), `sparecycles up` processes (`processes`), TensorBoard scalars
(`events`), a private Valkey (`valkey`) and the interrupt-resume checks (`resume`). The fixtures that wrap
them are in tests/conftest.py."""
