"""Helpers shared by the tests (no tests here): a coordinator in a thread (`coordinator`), a fleet of processes
(`fleet`), tiny models (`models`, `quadratic`), end-to-end process helpers (`processes`) and the
interrupt-resume checks (`resume`). The fixtures that wrap them are in tests/conftest.py."""
