// epx: check, measure and size the expert-parallel all-to-all kernels.
#include <fmt/format.h>
#include <stdlib.h>

#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "epx/error.hpp"

int main(int argc, char** argv) {
  // Ranks that share a GPU need a hardware work queue each (InProcessWorld); CUDA reads this
  // once, when the first CUDA call creates the context, and allows at most 32.
  ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  CLI::App app{"epx: expert-parallel dispatch/combine for MoE inference"};
  app.require_subcommand(1);
  int exit_code = 0;
  epx::cli::add_check(app, exit_code);
  epx::cli::add_selftest(app, exit_code);
  epx::cli::add_sizes(app, exit_code);
  epx::cli::add_bench(app, exit_code);
  epx::cli::add_serve_bench(app, exit_code);
  epx::cli::add_tune(app, exit_code);
  epx::cli::add_launch(app, exit_code);
  epx::cli::add_diag(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const epx::UnsupportedError& e) {
    fmt::print(stderr, "epx: {}\n", e.what());
    return 3;
  } catch (const epx::Error& e) {
    fmt::print(stderr, "epx: {} error: {}\n", epx::to_string(e.code()), e.what());
    return 2;
  }
  return exit_code;
}
