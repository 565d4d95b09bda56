"""The native build in one place: which modules the install compiles with mypyc and the C module
beside them (`build`, setuptools' build hook), and whether this process uses that build
(`compiled`). Every compiled module is the same source as its pure-Python self; the C module
stands in for Python it is tied to bit for bit by tests."""
