"""mtpjax.device_values: the wrappers' per-call host values are device arrays made once, and
stay NumPy constants under a trace, whose mesh must not leak into later calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mtpjax import device_values
from mtpjax.verify.accept import check_temperature


def test_outside_a_trace_each_value_is_one_device_array():
    a = device_values.full((3,), True, "bool")
    assert isinstance(a, jax.Array) and a.dtype == jnp.bool_ and a.shape == (3,)
    assert device_values.full((3,), True, "bool") is a  # no new array, no transfer
    np.testing.assert_array_equal(a, True)
    t, key = check_temperature(0.0, None)
    assert isinstance(t, jax.Array) and t.dtype == jnp.float32 and float(t) == 0.0
    assert check_temperature(0, None)[0] is t and key is None


def test_under_a_trace_values_are_numpy_constants():
    seen = []

    @jax.jit
    def f(x):
        seen.append(device_values.full((2,), 1, "int32"))
        return x + seen[-1]

    np.testing.assert_array_equal(f(jnp.zeros(2, jnp.int32)), 1)
    assert isinstance(seen[0], np.ndarray)


def test_a_value_first_made_in_a_shard_map_serves_a_later_mesh():
    mesh_dp = jax.make_mesh((2,), ("dp",))

    def local(x):
        return x + device_values.full((1,), 5, "int32")

    f = jax.jit(jax.shard_map(local, mesh=mesh_dp, in_specs=P("dp"), out_specs=P("dp")))
    x = jax.device_put(jnp.zeros(2, jnp.int32), jax.NamedSharding(mesh_dp, P("dp")))
    np.testing.assert_array_equal(f(x), 5)
    # The same value outside any trace, next to an array on another mesh.
    mesh_tp = jax.make_mesh((4,), ("tp",))
    x = jax.device_put(jnp.zeros(4, jnp.int32), jax.NamedSharding(mesh_tp, P("tp")))
    g = jax.jit(lambda x, y: x + y)
    np.testing.assert_array_equal(g(x, device_values.full((1,), 5, "int32")), 5)


def test_as_int32_keeps_an_int32_array_and_converts_the_rest():
    x = jnp.arange(3, dtype=jnp.int32)
    assert device_values.as_int32(x) is x
    y = device_values.as_int32(np.arange(3, dtype=np.int64))
    assert y.dtype == jnp.int32
    np.testing.assert_array_equal(y, [0, 1, 2])
