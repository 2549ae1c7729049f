"""``from fastdata.dali import DALILoader``: the door to `fastdata.gpu.dali` (the same module object)."""
import sys; from .gpu import dali as _dali; sys.modules[__name__] = _dali  # noqa: E702
