// The one test main: Catch2 v2 builds its runner here (CATCH_CONFIG_FAST_COMPILE comes from
// tests/meson.build, for every test file alike); every other test file includes
// catch2/catch.hpp without CATCH_CONFIG_MAIN, so Catch's runner is compiled once.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
