#pragma once
#include <CLI/CLI.hpp>

namespace epx::cli {
// Each registers its subcommand on `app`; the callback runs it and sets the exit code.
void add_check(CLI::App& app, int& exit_code);
void add_selftest(CLI::App& app, int& exit_code);
void add_sizes(CLI::App& app, int& exit_code);
void add_bench(CLI::App& app, int& exit_code);
void add_tune(CLI::App& app, int& exit_code);
void add_launch(CLI::App& app, int& exit_code);
void add_serve_bench(CLI::App& app, int& exit_code);
// Diagnosis only, not in `epx --help` (diag.cpp).
void add_diag(CLI::App& app, int& exit_code);
}  // namespace epx::cli
