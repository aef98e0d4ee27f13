#pragma once
// The --json files of the epx commands (no CUDA: the CPU tests compile it too).

#include <nlohmann/json.hpp>

#include <string>

namespace epx::cli {

// True where `path` names a regular file or nothing yet (not a link, a device or a pipe, as
// /dev/stdout is): a file that write_json replaces as a whole.
bool regular_or_new(const std::string& path);

// Writes `doc` to --json `path` and, with `announce`, says so; InputError naming --json when that
// fails. A regular file (or a new one) is written as PATH.part and renamed over PATH, so that a
// reader, or a run cut short, never sees half a file; anything else (a link, a device, a pipe) is
// written in place, the link kept.
void write_json(const std::string& path, const nlohmann::json& doc, bool announce = true);

}  // namespace epx::cli
