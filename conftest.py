"""Repository-wide pytest setup, for the tests and the doctests in ``jaxext/`` alike."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _cpp_extensions_in_a_temporary_directory(tmp_path_factory):
    """``jaxext.cpp_extension`` builds go to a session directory, not the user's cache.

    Set through the environment, so the notebook kernels the suite starts inherit it.
    """
    with pytest.MonkeyPatch.context() as patch:
        root = tmp_path_factory.mktemp("cpp_extensions")
        patch.setenv("JAXEXT_EXTENSIONS_DIR", str(root))
        yield root
