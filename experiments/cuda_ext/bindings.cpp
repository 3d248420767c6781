#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include "add_one.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_probe, m) {
  m.def("add_one", &vq::add_one, "x"_a, nb::kw_only(), "stream"_a = nb::none());
}
