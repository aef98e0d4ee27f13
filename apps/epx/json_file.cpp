#include "json_file.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "epx/error.hpp"

namespace epx::cli {

bool regular_or_new(const std::string& path) {
  // The link itself, not what it names: a rename would replace the link.
  std::error_code ec;
  const auto type = std::filesystem::symlink_status(path, ec).type();
  return type == std::filesystem::file_type::not_found ||
         type == std::filesystem::file_type::regular;
}

void write_json(const std::string& path, const nlohmann::json& doc, bool announce) {
  const bool replace = regular_or_new(path);
  const std::string target = replace ? path + ".part" : path;
  std::ofstream out(target);
  out << doc.dump(2) << "\n";
  out.close();
  if (!out || (replace && std::rename(target.c_str(), path.c_str()) != 0)) {
    if (replace) std::remove(target.c_str());
    EPX_THROW(InputError, fmt::format("--json = '{}' could not be written", path));
  }
  if (announce) fmt::print("wrote {}\n", path);
}

}  // namespace epx::cli
