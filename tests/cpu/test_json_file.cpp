// The CLI's --json files (apps/epx/json_file.hpp): a regular or new file is replaced as a whole
// (no PATH.part left behind), a link is written through and kept (as /dev/stdout is), and a path
// that cannot be written is an InputError that names --json and the path.

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "epx/error.hpp"
#include "json_file.hpp"

namespace epx::cli {
namespace {

namespace fs = std::filesystem;

class JsonFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("epx_json_file_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static nlohmann::json read(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return nlohmann::json::parse(s.str());
  }
  bool no_part_files() const {
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().extension() == ".part") return false;
    return true;
  }

  fs::path dir_;
};

TEST_F(JsonFile, NewFileThenReplacedWhole) {
  const fs::path p = dir_ / "bench.json";
  write_json(p.string(), {{"complete", false}, {"sizes", {4096}}}, false);
  EXPECT_EQ(read(p), (nlohmann::json{{"complete", false}, {"sizes", {4096}}}));
  write_json(p.string(), {{"complete", true}, {"sizes", {4096, 8192}}}, false);
  EXPECT_EQ(read(p), (nlohmann::json{{"complete", true}, {"sizes", {4096, 8192}}}));
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(p)));
  EXPECT_TRUE(no_part_files());
}

TEST_F(JsonFile, LinkWrittenThroughAndKept) {
  const fs::path target = dir_ / "target.json", link = dir_ / "link.json";
  write_json(target.string(), {{"a", 1}}, false);
  fs::create_symlink(target, link);
  write_json(link.string(), {{"a", 2}}, false);
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(read(target), (nlohmann::json{{"a", 2}}));
  EXPECT_TRUE(no_part_files());
}

TEST_F(JsonFile, UnwritablePathNamesTheFlagAndThePath) {
  const fs::path p = dir_ / "missing" / "bench.json";
  try {
    write_json(p.string(), {{"a", 1}}, false);
    FAIL() << "no error for " << p;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--json = '" + p.string() + "'"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "missing"));
  EXPECT_TRUE(no_part_files());
}

TEST_F(JsonFile, OnlyRegularOrNewFilesAreReplaced) {
  const fs::path file = dir_ / "f.json", link = dir_ / "l.json";
  EXPECT_TRUE(regular_or_new(file.string()));  // nothing yet
  std::ofstream(file) << "{}";
  EXPECT_TRUE(regular_or_new(file.string()));
  fs::create_symlink(file, link);
  EXPECT_FALSE(regular_or_new(link.string()));
  EXPECT_FALSE(regular_or_new(dir_.string()));
  EXPECT_FALSE(regular_or_new("/dev/null"));  // a device
}

}  // namespace
}  // namespace epx::cli
