// The one test main: Catch2 v2 builds its runner here; every other test file includes
// catch2/catch.hpp without CATCH_CONFIG_MAIN, so Catch's runner is compiled once.
#define CATCH_CONFIG_MAIN
#define CATCH_CONFIG_FAST_COMPILE
#include <catch2/catch.hpp>
