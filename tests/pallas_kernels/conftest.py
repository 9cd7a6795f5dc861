"""Parametrizes the kernel suite (:mod:`tests.pallas_kernels.suite`) from the class
attributes of each kernel's test class."""


def _id(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):  # (case, reason): the reason
        return str(value[-1])
    return value.id


def pytest_generate_tests(metafunc):
    cls = metafunc.cls
    if cls is None:
        return
    for fixture, attribute in (("case", "CASES"), ("unsupported", "UNSUPPORTED"),
                               ("needle_spec", "NEEDLE_SPECS")):
        if fixture in metafunc.fixturenames:
            values = getattr(cls, attribute)
            metafunc.parametrize(fixture, values, ids=[_id(v) for v in values])
