"""Exceptions users meet carry public names: importable, catchable, and so named in tracebacks."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxext
from jaxext import cpp_extension

# Every exception class jaxext defines that can reach a user, by the name users import.
PUBLIC_ERRORS = {
    "jaxext.RuleTypeError": jaxext.RuleTypeError,
    "jaxext.RuleValueError": jaxext.RuleValueError,
    "jaxext.ClosedOverValueError": jaxext.ClosedOverValueError,
    "jaxext.GradcheckError": jaxext.GradcheckError,
    "jaxext.GradcheckUnresolvedWarning": jaxext.GradcheckUnresolvedWarning,
    "jaxext.OpcheckError": jaxext.OpcheckError,
    "jaxext.cpp_extension.ExtensionError": cpp_extension.ExtensionError,
    "jaxext.cpp_extension.CompilerNotFoundError": cpp_extension.CompilerNotFoundError,
    "jaxext.cpp_extension.CompileError": cpp_extension.CompileError,
    "jaxext.cpp_extension.MissingHandlerError": cpp_extension.MissingHandlerError,
}

# Exceptions that never leave jaxext, each with where it is caught.
INTERNAL_ERRORS = {
    "CheckFailed": "opcheck records it as a FAIL row (OpcheckError reports the failures)",
    "Skip": "opcheck records it as a SKIP row",
    "Unresolved": "opcheck records it as an UNRESOLVED row",
    "_Skip": "optimize_remat's signal inside run_fwd: fwd is then called as it is",
}


def _exception_classes_defined_in_jaxext() -> dict[str, type]:
    """``{qualname: class}`` for every exception class defined in any jaxext module."""
    found = {}
    modules = [jaxext, *(importlib.import_module(m.name) for m in _walk())]
    for module in modules:
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.split(".")[0] == "jaxext"
            ):
                found[value.__qualname__] = value
    return found


def _walk():
    return pkgutil.walk_packages(jaxext.__path__, "jaxext.")


def _shown_as(error: BaseException) -> str:
    """The traceback line naming the error, ``module.Class: message`` (before any notes)."""
    return traceback.format_exception_only(type(error), error)[0]


def test_every_exception_class_is_public_or_internal():
    defined = _exception_classes_defined_in_jaxext()
    public = {cls.__qualname__ for cls in PUBLIC_ERRORS.values()}
    assert set(defined) == public | set(INTERNAL_ERRORS), (
        "an exception class is neither listed as public (exported, with its public __module__) "
        f"nor as internal: {sorted(set(defined) - public - set(INTERNAL_ERRORS))}"
    )


@pytest.mark.parametrize("name", sorted(PUBLIC_ERRORS))
def test_public_error_is_exported_and_named_publicly(name):
    cls = PUBLIC_ERRORS[name]
    module, _, qualname = name.rpartition(".")
    assert f"{cls.__module__}.{cls.__qualname__}" == name
    assert getattr(importlib.import_module(module), qualname) is cls
    assert qualname in getattr(importlib.import_module(module), "__all__", [qualname])
    assert not any(part.startswith("_") for part in name.split("."))
    assert issubclass(cls, Exception)


def test_gradcheck_error_is_shown_as_jaxext_gradcheck_error():
    @jax.custom_vjp
    def wrong(x):
        return 2.0 * x

    wrong.defvjp(lambda x: (wrong(x), None), lambda _, g: (3.0 * g,))
    with pytest.raises(jaxext.GradcheckError) as caught:
        jaxext.gradcheck(wrong, (np.ones(2),))
    assert _shown_as(caught.value).startswith("jaxext.GradcheckError: Jacobian mismatch")


def test_opcheck_error_is_shown_as_jaxext_opcheck_error():
    @jax.custom_vjp
    def wrong(x):
        return 2.0 * x

    wrong.defvjp(lambda x: (wrong(x), None), lambda _, g: (3.0 * g,))
    with pytest.raises(jaxext.OpcheckError) as caught:
        jaxext.opcheck(wrong, (np.ones(2),))
    assert _shown_as(caught.value).startswith("jaxext.OpcheckError: ")
    assert "gradcheck" in caught.value.failed


def test_rule_errors_are_shown_with_public_names():
    @jaxext.custom_vjp
    def f(x, y):
        return x * y

    f.defvjp(lambda x, y: (f(x, y), (x, y)), lambda res, g: (g * res[1],))  # one gradient short
    with pytest.raises(jaxext.RuleTypeError) as caught:
        jax.grad(f, argnums=(0, 1))(1.0, 2.0)
    assert _shown_as(caught.value).startswith("jaxext.RuleTypeError: ")

    @jaxext.custom_vjp
    def g(x):
        return 2.0 * x

    g.defvjp(lambda x: (g(x), None), lambda _, ct: (jnp.ones(3),))  # wrong shape
    with pytest.raises(jaxext.RuleValueError) as caught:
        jax.grad(lambda x: g(x).sum())(jnp.ones(2))
    assert _shown_as(caught.value).startswith("jaxext.RuleValueError: ")


def test_compiler_not_found_is_shown_with_its_public_name(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpp_extension.CompilerNotFoundError) as caught:
        cpp_extension.load_inline(
            "no_compiler_ext", "// not built", functions=["f"], build_directory=str(tmp_path)
        )
    assert _shown_as(caught.value).startswith("jaxext.cpp_extension.CompilerNotFoundError: ")
    assert isinstance(caught.value, cpp_extension.ExtensionError)


@pytest.mark.parametrize("name", sorted(n for n in PUBLIC_ERRORS if "cpp_extension" in n))
def test_extension_errors_are_shown_with_public_names(name):
    cls = PUBLIC_ERRORS[name]
    kwargs = {"command": ["c++"], "output": "", "log_path": "build.log"}
    error = cls("message", **kwargs) if cls is cpp_extension.CompileError else cls("message")
    assert _shown_as(error) == f"{name}: message\n"


def test_differentiating_a_bare_ffi_call_names_the_handler_and_how_to_give_it_a_gradient():
    """JAX's own message names the target and suggests "`jax.custom_jvp` or `jax.custom_jvp`"."""
    # Never registered and never run: differentiation fails while tracing, before any call.
    kernel = cpp_extension.FfiFunction("square", "my_ext_square", "cpu")

    def f(x):
        out = kernel(x, result_shape_dtypes=jax.ShapeDtypeStruct(x.shape, x.dtype))
        return out.sum()

    x = jnp.ones(3)
    for differentiate in (
        lambda: jax.grad(f)(x),
        lambda: jax.jit(jax.grad(f))(x),
        lambda: jax.jvp(f, (x,), (x,)),
    ):
        with pytest.raises(ValueError) as info:
            differentiate()
        message = str(info.value)
        assert message.startswith("The C++ handler `square` (FFI target `my_ext_square`)")
        assert "@jaxext.custom_vjp" in message and ".defvjp(fwd, bwd, jvp=...)" in message
        assert "jax.custom_jvp` or `jax.custom_jvp" not in message
